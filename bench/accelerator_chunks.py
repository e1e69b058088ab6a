"""The part `chunks` of `python -m bench --accelerator`: what cutting a
causal LM's loss into chunks of tokens costs against whole logits, in one
fresh process (`--child chunks`).

A bound model takes its loss a chunk of tokens at a time past a device's
`WHOLE_LOGITS_BYTES` of float32 logits (`keras_hub_autodist.loss.chunks`);
each chunk reads the head's weights again. Here one autodist model is
compiled and timed under each rule of `CHUNK_VARIANTS` in turn, over
`CHUNK_ROUNDS` rounds, so that the variants share the process, the weights
and the batch, and the ratios are of medians measured side by side. The
rules are set on the package's module for the step compiled after: the
bench may do so, the package never does.
"""

from __future__ import annotations

import contextlib
import statistics
import time

# variant -> the `loss.chunks` constants it sets while its step compiles:
# whole logits (Keras' own step, a small head too), chunks of the 256 MiB
# floor alone, and the rule as shipped forced on at any size.
CHUNK_VARIANTS = {
    "whole logits": dict(WHOLE_LOGITS_BYTES=2**62, FEWEST_CHUNKS=1),
    "chunks of 256 MiB": dict(WHOLE_LOGITS_BYTES=0, FEWEST_TOKENS=0),
    "chunks of 512 tokens": dict(WHOLE_LOGITS_BYTES=0),
}
CHUNK_ROUNDS = 2


def chunk_order(rounds: int) -> list[tuple[int, str]]:
    """`(round, variant)` in the order one process measures them: each
    round runs every variant, the odd rounds in reverse.

    Example:
    >>> [v[:6] for _, v in chunk_order(2)]
    ['whole ', 'chunks', 'chunks', 'chunks', 'chunks', 'whole ']
    """
    names = list(CHUNK_VARIANTS)
    return [
        (i, name)
        for i in range(rounds)
        for name in (names if i % 2 == 0 else names[::-1])
    ]


@contextlib.contextmanager
def chunk_rule(variant: str, counts: list[int]):
    """Set `variant`'s constants on `keras_hub_autodist.loss.chunks`, and
    append each chunk count a step asks for to `counts`; restored after."""
    from keras_hub_autodist.loss import chunked_steps
    from keras_hub_autodist.loss import chunks

    saved = {name: getattr(chunks, name) for name in CHUNK_VARIANTS[variant]}
    counting = chunked_steps.chunk_count

    def counted(*args, **kwargs):
        counts.append(counting(*args, **kwargs))
        return counts[-1]

    try:
        for name, value in CHUNK_VARIANTS[variant].items():
            setattr(chunks, name, value)
        chunked_steps.chunk_count = counted
        yield
    finally:
        chunked_steps.chunk_count = counting
        for name, value in saved.items():
            setattr(chunks, name, value)


def child_chunks(path, lora_rank, batch, seq, steps, warmup, emit) -> None:
    """Time one autodist model's `train_on_batch` under each chunk rule.

    Args:
        path: the preset.
        lora_rank: 0 trains every weight; otherwise `enable_lora(rank)`.
        batch: sequences per step.
        seq: tokens per sequence.
        steps: timed steps per variant and round, after `warmup` untimed.
        emit: called with each `(round, variant)`'s row: its median step,
            its first loss (from the same weights in every row), the chunks
            its step was cut into (1: whole logits) and its program's
            memory.
    """
    import keras
    import keras_hub
    import numpy as np

    import keras_hub_autodist  # noqa: F401  (the plugin)
    from bench import accelerator_program
    from bench.accelerator_training import ONE_DEVICE
    from bench.accelerator_training import step_seconds

    lm = keras_hub.models.CausalLM.from_preset(
        path, preprocessor=None, dtype="bfloat16", device_mesh=ONE_DEVICE
    )
    if lora_rank:
        lm.backbone.enable_lora(lora_rank)
    vocabulary = lm.backbone.vocabulary_size
    ids = np.random.default_rng(0).integers(1, vocabulary, (batch, seq))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids, "int32")}
    y = np.roll(x["token_ids"], -1, axis=1)
    # Each rule starts from the same weights, so that its first loss can be
    # held against the others'.
    initial = [variable.numpy() for variable in lm.trainable_variables]
    for round_, variant in chunk_order(CHUNK_ROUNDS):
        for variable, value in zip(lm.trainable_variables, initial):
            variable.assign(value)
        row = dict(batch=batch, round=round_, variant=variant)
        counts = []
        started = time.perf_counter()
        try:
            recording = accelerator_program.recording_steps()
            with chunk_rule(variant, counts), recording as recorded:
                # A fresh compile: Keras builds the step again, under the rule.
                lm.compile(optimizer=keras.optimizers.Adam(1e-5))
                losses = []
                times = step_seconds(lm, x, y, warmup + steps, losses)
                row.update(accelerator_program.program_memory(recorded))
        except Exception as error:  # noqa: BLE001 - reported as the row
            row["error"] = [f"{type(error).__name__}: {error}"[:400]]
            emit(row)
            continue
        step = statistics.median(times[warmup:])
        row.update(
            chunks=counts[-1] if counts else 1,
            first_step_s=times[0],
            first_loss=losses[0],
            step_s=step,
            tokens_per_s=batch * seq / step,
            seconds=time.perf_counter() - started,
        )
        emit(row)
