"""The training measurement of `python -m bench --accelerator`, run in a
fresh process (`--child train`): one model, one variant (plain keras-hub or
autodist on a one-device mesh), a ladder of batch sizes.

Each rung is a JSON line on stdout as soon as it is measured, so that a
child stopped by its time limit keeps the rungs it finished.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

ONE_DEVICE = {"batch": 1, "model": 1}


def climb(batches, measure: Callable[[int], dict]) -> list[dict]:
    """Measure each batch of a ladder in turn, smallest first, and stop at
    the first the device refuses (a row with `"refused": True`) or that
    fails for any other reason (a row with `"error"`): a larger batch would
    be refused too.

    Args:
        batches: the ladder's batch sizes, smallest first.
        measure: measures one batch and returns its row.

    Returns:
        The rows measured, the refused or failed one last.

    Example:
    >>> rows = climb([4, 8, 12, 16], lambda b: {"batch": b, "refused": b > 8})
    >>> [r["batch"] for r in rows]
    [4, 8, 12]
    """
    rows = []
    for batch in batches:
        row = measure(batch)
        rows.append(row)
        if row.get("refused") or "error" in row:
            break
    return rows


def step_seconds(lm, x, y, count, losses=None) -> list[float]:
    """Seconds of each of `count` `train_on_batch` calls, each waited for;
    each step's loss appended to `losses` where given."""
    import jax

    times = []
    for _ in range(count):
        start = time.perf_counter()
        logs = lm.train_on_batch(x, y, return_dict=True)
        jax.block_until_ready(logs["loss"])
        times.append(time.perf_counter() - start)
        if losses is not None:
            losses.append(float(logs["loss"]))
    return times


def host_phases(lm, x, y, count) -> dict:
    """Median milliseconds of `count` `train_on_batch` calls, by phase:
    before the jitted step is called (checks, data placement, state
    gathering), the call itself (dispatch: it returns before the device
    ends), and after it (the device's time, the state put back, the logs
    read). Each call is waited for, as `step_seconds` does; nothing else
    is waited for, so the phases add up to the step."""
    import jax

    step = lm.train_function
    called = {}

    def timed(state, data):
        called["start"] = time.perf_counter()
        outputs = step(state, data)
        called["end"] = time.perf_counter()
        return outputs

    object.__setattr__(lm, "train_function", timed)
    phases = {"before_ms": [], "call_ms": [], "after_ms": []}
    try:
        for _ in range(count):
            start = time.perf_counter()
            logs = lm.train_on_batch(x, y, return_dict=True)
            jax.block_until_ready(logs["loss"])
            end = time.perf_counter()
            phases["before_ms"].append(called["start"] - start)
            phases["call_ms"].append(called["end"] - called["start"])
            phases["after_ms"].append(end - called["end"])
    finally:
        object.__setattr__(lm, "train_function", step)
    return {key: statistics.median(v) * 1e3 for key, v in phases.items()}


def fit_seconds(lm, x, y, count, warmup=1) -> float:
    """Seconds of one `fit` epoch over `count` batches of `x`'s rows, after
    an untimed epoch of `warmup` batches: `fit` feeds its step a batch of
    another structure than `train_on_batch` (no sample weights), so its
    first epoch traces and compiles the step again, and a second process
    finds that program in the persistent compilation cache."""
    import numpy as np

    rows = len(y)

    def epoch(batches):
        xs = {key: np.concatenate([value] * batches) for key, value in x.items()}
        ys = np.concatenate([y] * batches)
        lm.fit(xs, ys, batch_size=rows, epochs=1, verbose=0)

    epoch(max(warmup, 1))
    start = time.perf_counter()
    epoch(count)
    return time.perf_counter() - start


def device_memory():
    """(peak, in use) bytes of the first device; (None, in use summed over
    live arrays) where the backend keeps no statistics (the CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats:
        return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")
    return None, sum(a.nbytes for a in jax.live_arrays())


def _answers(path, lora_rank, batch, seq, local_check, remat=None) -> dict:
    """The package's answers for this step before it runs: the closed forms
    (the plan's, and the calibrated one for this platform) and, with
    `local_check`, the step compiled on this device (`compiled_memory`)."""
    import jax
    import keras

    import keras_hub_autodist
    from keras_hub_autodist.fitting import step_memory

    devices = keras.distribution.list_devices()[:1]
    mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    plan = keras_hub_autodist.plan(
        path, mesh, dtype="bfloat16", lora_rank=lora_rank or None, remat=remat
    )
    row = {}
    if local_check:
        start = time.perf_counter()
        compiled = keras_hub_autodist.compiled_memory(plan, batch, seq, "adam")
        row["compiled_check_s"] = time.perf_counter() - start
        row["compiled_peak_bytes"] = compiled.peak_bytes
    row["closed_form_bytes"] = plan.training_bytes_per_device(
        "adam"
    ) + plan.activation_bytes_per_device(batch, seq)
    row["calibrated_bytes"] = step_memory.step_estimate(
        plan, batch, seq, "adam", platform=jax.devices()[0].platform
    ).total_bytes
    return row


def _measure(lm, recorded, batch, seq, steps, warmup, time_fit=True) -> dict:
    """One rung: `warmup + steps` `train_on_batch` calls of `batch`
    sequences; the program's memory, or what the device refused; with
    `time_fit`, `fit`'s tokens/s over `steps` batches too."""
    import numpy as np

    from bench import accelerator_program

    vocabulary = lm.backbone.vocabulary_size
    ids = np.random.default_rng(0).integers(1, vocabulary, (batch, seq))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids, "int32")}
    y = np.roll(x["token_ids"], -1, axis=1)
    row = dict(batch=batch)
    losses = []
    try:
        times = step_seconds(lm, x, y, warmup + steps, losses)
    except Exception as error:  # noqa: BLE001 - reported as the rung's row
        refused = accelerator_program.refused_memory(error, recorded)
        if refused is None:
            row["error"] = [f"{type(error).__name__}: {error}"[:400]]
            return row
        row.update(refused=True, **refused)
        row["error"] = [str(error).strip().splitlines()[0][:400]]
        return row
    row.update(accelerator_program.program_memory(recorded))
    # After the timed steps, so that they run as a user's do.
    row["host_phases"] = host_phases(lm, x, y, steps)
    try:  # keras-hub's `fit` needs grain or tensorflow to batch arrays
        if time_fit:
            seconds = fit_seconds(lm, x, y, steps, warmup)
            row["fit_tokens_per_s"] = batch * seq * steps / seconds
    except ImportError as error:
        row["fit_error"] = str(error)[:200]
    peak, final = device_memory()
    step = statistics.median(times[warmup:])
    params = lm.backbone.count_params()
    tokens = batch * seq / step
    row.update(
        refused=False,
        first_step_s=times[0],
        first_loss=losses[0],
        step_s=step,
        tokens_per_s=tokens,
        tflops=6 * params * tokens / 1e12,
        params=params,
        peak_bytes=peak,
        final_bytes=final,
    )
    return row


def _generate_rate(lm, batch, seq, generate) -> float:
    """Greedy `generate` of `generate` new tokens after 8: tokens per second."""
    import numpy as np

    ids = np.random.default_rng(0).integers(
        1, lm.backbone.vocabulary_size, (batch, seq)
    )
    mask = np.zeros((batch, seq), "int32")
    mask[:, :8] = 1
    prompt = {"token_ids": (ids * mask).astype("int32"), "padding_mask": mask}
    length = 8 + generate
    lm.compile(sampler="greedy")
    lm.generate(prompt, max_length=length, stop_token_ids=None)  # compile
    start = time.perf_counter()
    lm.generate(prompt, max_length=length, stop_token_ids=None)
    return batch * generate / (time.perf_counter() - start)


def child_train(
    path: str,
    variant: str,
    lora_rank: int,
    batches: list[int],
    seq: int,
    steps: int,
    warmup: int,
    generate: int,
    local_check: bool,
    remat: str | None = None,
    emit: Callable[[dict], None] = lambda row: print(json.dumps(row), flush=True),
) -> list[dict]:
    """Train one model on a ladder of batches, in this fresh process.

    Args:
        path: the preset.
        variant: "keras-hub" (plain `from_preset`), "autodist" (a
            one-device mesh, with the package's answers beside each rung)
            or "autodist-xla" (the same, its layers attending with their
            own XLA attention instead of the per-device kernel).
        lora_rank: 0 trains every weight; otherwise `enable_lora(rank)`.
        batches: the ladder (`climb`).
        seq: tokens per sequence.
        steps: timed steps per rung, after `warmup` untimed ones.
        generate: new tokens of a greedy `generate` timing at the first
            batch that ran, after the ladder (a row of its own); 0 skips it.
        local_check: also compile each rung with `compiled_memory` first.
        remat: autodist's `remat=` (None: none).
        emit: called with each rung's row as soon as it is measured.

    Returns:
        The rungs' rows.
    """
    import keras
    import keras_hub

    import keras_hub_autodist  # noqa: F401  (the plugin, without a .pth hook)
    from bench import accelerator_program

    kwargs = dict(preprocessor=None, dtype="bfloat16")
    if variant == "autodist-xla":
        from keras_hub_autodist.attention import attention_blocks

        attention_blocks.PLATFORM_KERNELS = {}
    if variant.startswith("autodist"):
        kwargs["device_mesh"] = ONE_DEVICE
        if remat:
            kwargs["remat"] = remat
    start = time.perf_counter()
    lm = keras_hub.models.CausalLM.from_preset(path, **kwargs)
    load_s = time.perf_counter() - start
    if lora_rank:
        lm.backbone.enable_lora(lora_rank)
    # The task's default loss and metrics, as the target compile compiles.
    lm.compile(optimizer=keras.optimizers.Adam(1e-5))

    # One recording for the whole ladder: Keras builds its jitted step once
    # and keeps it for every batch.
    with accelerator_program.recording_steps() as recorded:

        def measure(batch):
            row = dict(load_s=load_s)
            if variant == "autodist":
                row.update(_answers(path, lora_rank, batch, seq, local_check, remat))
            # `fit` compiles its own step: timed on the first rung only.
            first = batch == batches[0]
            row.update(_measure(lm, recorded, batch, seq, steps, warmup, first))
            emit(row)
            return row

        rows = climb(batches, measure)
    ran = [r for r in rows if not r.get("refused") and "error" not in r]
    if generate and ran:
        # Last: compiling for `generate` replaces the training optimizer.
        rate = _generate_rate(lm, ran[0]["batch"], seq, generate)
        emit(dict(batch=ran[0]["batch"], generate_tokens_per_s=rate))
    return rows
