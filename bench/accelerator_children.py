"""The measurements of `python -m bench --accelerator` but training's
(`accelerator_training`), each run in a fresh process
(`python -m bench.accelerator --child KIND ...`) with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`, so that the device's `memory_stats()`
peak is that measurement's own:

- `probe`: the machine's device (the parent never opens it: a TPU chip
  serves one process at a time);
- `load`: `Backbone.from_preset`, keras-hub or autodist, or a raw read;
- `long`: one long LoRA sequence and the attention kernel XLA chose;
- `attention`: causal attention alone, fused kernel against blockwise;
- `chunks`: the loss whole and in chunks (`accelerator_chunks`).

A child prints JSON lines; the last is its result (a training child prints
one per rung).
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time
import warnings

from bench.accelerator_chunks import child_chunks
from bench.accelerator_training import ONE_DEVICE
from bench.accelerator_training import child_train
from bench.accelerator_training import device_memory
from bench.accelerator_training import step_seconds
from bench.file_reads import read_file_only


def _setup_child():
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_HUB_AUTODIST_PROGRESS"] = "0"


def child_probe() -> dict:
    """The first device's platform, kind and count, and the memory a
    program may use where the backend says (`bytes_limit`)."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return dict(
        platform=device.platform,
        device_kind=device.device_kind,
        devices=len(jax.devices()),
        bytes_limit=stats.get("bytes_limit"),
    )


def child_load(path, variant, dtype) -> dict:
    """Seconds, device peak and final bytes of one `Backbone.from_preset`
    (`variant` "keras-hub" or "autodist"), or of reading the files alone
    (`variant` None)."""
    if variant is None:
        start = time.perf_counter()
        read = read_file_only(path)
        return dict(seconds=time.perf_counter() - start, bytes_read=read)
    import jax
    import keras_hub

    import keras_hub_autodist  # noqa: F401  (the plugin, without a .pth hook)

    kwargs = {} if dtype is None else {"dtype": dtype}
    if variant == "autodist":
        kwargs["device_mesh"] = ONE_DEVICE
    # Open the device before the clock starts: opening a TPU chip takes
    # seconds that neither variant's loading spends.
    jax.devices()
    start = time.perf_counter()
    backbone = keras_hub.models.Backbone.from_preset(path, **kwargs)
    for weight in backbone.weights:
        weight.value.block_until_ready()
    seconds = time.perf_counter() - start
    peak, final = device_memory()
    return dict(
        seconds=seconds,
        peak_bytes=peak,
        final_bytes=final,
        params=backbone.count_params(),
        variable_dtype=str(backbone.weights[0].dtype),
    )


def _attention_kernels(dump: pathlib.Path) -> list[str]:
    """The fused attention kernels XLA called in the optimized programs it
    dumped: cuDNN's (`__cudnn$fmha...`) or a Pallas kernel's, else none."""
    from keras_hub_autodist.fitting.compiled_analysis import attention_kernel

    found = set()
    for path in dump.glob("*after_optimizations*.txt"):
        text = path.read_text(errors="replace")
        for word in text.split('"'):
            if word.startswith("__cudnn$fmha") or "flash" in word.lower():
                found.add(word)
        kernel = attention_kernel(text)
        if kernel not in ("", "xla"):
            found.add(kernel)
    return sorted(found)


def child_long(path, variant, seq, steps) -> dict:
    """A one-sequence LoRA step at `seq` tokens, the attention kernel XLA
    chose for it (read from the optimized program it dumped), its step time
    and device peak. `variant` "keras-hub" is plain `from_preset`,
    "autodist" a one-device mesh: the distribution must keep the fused
    kernel keras-hub picks. (A context axis needs more than one device.)"""
    import keras
    import keras_hub
    import numpy as np

    import keras_hub_autodist  # noqa: F401  (the plugin, without a .pth hook)

    dump = pathlib.Path(os.environ["BENCH_XLA_DUMP"])
    kwargs = dict(preprocessor=None, dtype="bfloat16")
    if variant == "autodist":
        kwargs["device_mesh"] = ONE_DEVICE
    lm = keras_hub.models.CausalLM.from_preset(path, **kwargs)
    lm.backbone.enable_lora(8)
    lm.compile(optimizer=keras.optimizers.Adam(1e-5))
    ids = np.random.default_rng(0).integers(1, 1000, (1, seq)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = np.roll(ids, -1, axis=1)
    times = step_seconds(lm, x, y, 1 + steps)
    peak, final = device_memory()
    return dict(
        first_step_s=times[0],
        step_s=statistics.median(times[1:]),
        tokens_per_s=seq / statistics.median(times[1:]),
        peak_bytes=peak,
        final_bytes=final,
        attention_kernels=_attention_kernels(dump),
    )


def attention_function(variant, queries, keys, heads, kv_heads, head_dim, interpret):
    """The attention function of `variant` over `[1, tokens, heads, dim]`;
    `interpret` runs the splash kernel in Pallas' interpreter (off a TPU)."""
    import jax
    import jax.numpy as jnp

    scale = head_dim**-0.5
    groups = heads // kv_heads
    if variant in ("blockwise", "splash"):
        from keras_hub_autodist.attention import blockwise_attention as blockwise

        rule = blockwise.AttentionRule(scale=scale)
        query_positions = jnp.arange(keys - queries, keys, dtype=jnp.int32)
        key_positions = jnp.arange(keys, dtype=jnp.int32)
        valid = jnp.ones((1, keys), bool)
    if variant == "blockwise":

        def attend(q, k, v):
            grouped = q.reshape(1, queries, kv_heads, groups, head_dim)
            out = blockwise.blockwise_attention(
                rule, grouped, k, v, query_positions, key_positions, valid
            )
            return out.reshape(1, queries, heads, head_dim)

        return attend
    if queries != keys:
        raise SystemExit(f"{variant} attends a whole sequence")
    if variant == "splash":
        # Pallas' splash kernel on one device (a context axis of 1).
        from keras_hub_autodist.attention import splash_attention as splash

        kernel = splash.splash_kernel(rule, keys, 1, False, groups, interpret)

        def attend(q, k, v):
            grouped = q.reshape(1, queries, kv_heads, groups, head_dim)
            out = splash.attend(kernel, rule, grouped, k, v, query_positions, valid)
            return out.reshape(1, queries, heads, head_dim)

        return attend

    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=variant
        )

    return attend


def child_attention(variant, queries, keys, heads, kv_heads, head_dim, repeats):
    """Causal attention alone, forward and backward, in bfloat16: `queries`
    (the last of the sequence) against `keys`. `variant` "cudnn" and "xla"
    are `jax.nn.dot_product_attention`'s implementations, "splash" Pallas'
    TPU kernel (`attention.splash_attention`) and "blockwise" the per-device
    attention of the context axis (`attention.blockwise_attention`). Median
    seconds, device peak and the program's memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_hub_autodist.fitting.compiled_analysis import attention_kernel

    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q = normal(1, queries, heads, head_dim)
    k = normal(1, keys, kv_heads, head_dim)
    v = normal(1, keys, kv_heads, head_dim)
    interpret = jax.devices()[0].platform != "tpu"
    sizes = (queries, keys, heads, kv_heads, head_dim)
    attend = attention_function(variant, *sizes, interpret)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    peak, _ = device_memory()
    compiled = step.lower(q, k, v).compile()
    text = compiled.as_text()
    analysis = compiled.memory_analysis()
    fused = {w for w in text.split('"') if w.startswith("__cudnn$fmha")}
    kernel = attention_kernel(text)
    if kernel not in ("", "xla"):
        fused.add(kernel)
    return dict(
        compile_s=compile_s,
        step_s=statistics.median(times),
        peak_bytes=peak,
        program_bytes=getattr(analysis, "temp_size_in_bytes", 0)
        + getattr(analysis, "argument_size_in_bytes", 0)
        + getattr(analysis, "output_size_in_bytes", 0)
        - getattr(analysis, "alias_size_in_bytes", 0),
        fused=sorted(fused),
    )


def _none(text):
    return None if text == "-" else text


def child_rows(kind, *args) -> dict | None:
    """Run the child `kind` with its command-line `args`; its result, or
    None for training and `chunks`, whose rows are printed as they come."""
    if kind == "probe":
        return child_probe()
    if kind == "load":
        path, variant, dtype = args
        return child_load(path, _none(variant), _none(dtype))
    if kind == "attention":
        variant, *sizes = args
        return child_attention(variant, *map(int, sizes))
    if kind == "long":
        path, variant, seq, steps = args
        return child_long(path, variant, int(seq), int(steps))
    if kind == "chunks":
        path, lora, batch, seq, steps, warmup = args
        sizes = (int(lora), int(batch), int(seq), int(steps), int(warmup))
        child_chunks(path, *sizes, emit=lambda row: print(json.dumps(row), flush=True))
        return None
    if kind == "train":
        path, variant, lora, batches, seq, steps, warmup, generate, check, remat = args
        batches = [int(b) for b in batches.split(",")]
        sizes = (int(lora), batches, int(seq), int(steps), int(warmup))
        remat = None if remat == "-" else remat
        child_train(path, variant, *sizes, int(generate), check == "1", remat)
        return None
    raise SystemExit(f"unknown child {kind!r}")


def child_main(argv) -> None:
    """`--child KIND ARGS...`: one measurement; its result as the last JSON
    line, with the Python warnings raised during it (Keras' sharding
    warnings among them), each once."""
    _setup_child()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = child_rows(*argv)
    said = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in caught})
    print(json.dumps(dict(row or {}, warnings=said, done=True)))
