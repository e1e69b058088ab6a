"""`python -m bench.accelerator` (or `python -m bench --accelerator`): the
benchmark for one accelerator, in under 8 minutes on one H200.

It makes its own presets (random weights, saved by keras-hub in bfloat16):
nothing is downloaded. Every measurement runs in a fresh process (`--child`)
with `XLA_PYTHON_CLIENT_PREALLOCATE=false`, so that the device's
`memory_stats()` peak is that measurement's own:

- loading a Gemma 7B-shaped preset with `Backbone.from_preset`: keras-hub,
  autodist on a one-device mesh, and a single-threaded h5py read of the
  files; with `dtype="bfloat16"` and without `dtype=` (a float32 model from
  the bfloat16 file); seconds, device peak and final bytes;
- training a Gemma 2B-shaped `GemmaCausalLM` in bfloat16, batch 4 x 1024
  tokens, Adam, `train_on_batch`: median seconds per step after warm-up,
  tokens/s and model TFLOP/s (6 x parameters x tokens), keras-hub against
  autodist, the device peak against the compiled check
  (`plan.compiled_memory`) and the closed forms (the plan's, and
  `step_memory.step_estimate` for the device's platform);
- greedy `generate`: new tokens per second, both variants.

It writes `accelerator.json` and `accelerator.md` (the section "On one
accelerator", the machine named from `nvidia-smi` or JAX's device kind)
under `$OUT` or `--out`; `--insert docs/benchmarks.md` puts the section in
that file (replacing an earlier one). `--tiny` runs tiny shapes on any
machine, the CPU included, in a minute or two.

On a machine without Keras (../shared/ACCELERATOR.md), bring wheels of
keras, keras-hub, namex, optree and this project: `scripts/accelerator_kit.sh`
puts them in `.whl/`, and its header has the command that installs them
there (`pip install --no-index --no-deps --target DIR`) and runs this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from bench import accelerator_steps
from bench import accelerator_targets
from bench.accelerator_steps import GEMMA_2B
from bench.accelerator_steps import GEMMA_7B
from bench.accelerator_steps import TINY
from bench.file_reads import read_file_only

LOAD_VARIANTS = [
    ("raw read", None, None),
    ("keras-hub", "keras-hub", "bfloat16"),
    ("autodist", "autodist", "bfloat16"),
    ("keras-hub", "keras-hub", None),
    ("autodist", "autodist", None),
]
ONE_DEVICE = {"batch": 1, "model": 1}
PARTS = ("load", "train", "long", "attention")
# The parts that use each preset.
PRESET_PARTS = {"7b": {"load", "train"}, "2b": {"train", "long"}}
# One sequence of the Gemma 2B shape, LoRA, at these lengths (`child_long`).
LONG_SEQUENCES = [32768]
LONG_SEQUENCES_TINY = [256]
# Attention alone (`child_attention`): (variant, queries, keys). A whole
# 32k-token sequence on one device with cuDNN's kernel and the per-device
# blockwise one, then one device's share of a context axis of 8. (XLA's own
# attention holds the 32k x 32k scores per head; it is run on tiny shapes.)
ATTENTION_CASES = [
    ("cudnn", 32768, 32768),
    ("blockwise", 32768, 32768),
    ("blockwise", 4096, 32768),
]
ATTENTION_CASES_TINY = [
    ("xla", 256, 256),
    ("blockwise", 256, 256),
    ("blockwise", 64, 256),
]
GB = 1e9


# --- children: one measurement each, in a fresh process -----------------------


def _setup_child():
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_HUB_AUTODIST_PROGRESS"] = "0"


def _device_memory():
    """(peak, in use) bytes of the first device; (None, in use summed over
    live arrays) where the backend keeps no statistics (the CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats:
        return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")
    return None, sum(a.nbytes for a in jax.live_arrays())


def child_load(path, variant, dtype):
    if variant is None:
        start = time.perf_counter()
        read = read_file_only(path)
        return dict(seconds=time.perf_counter() - start, bytes_read=read)
    import keras_hub

    import keras_hub_autodist  # noqa: F401  (the plugin, without a .pth hook)

    kwargs = {} if dtype is None else {"dtype": dtype}
    if variant == "autodist":
        kwargs["device_mesh"] = ONE_DEVICE
    start = time.perf_counter()
    backbone = keras_hub.models.Backbone.from_preset(path, **kwargs)
    for weight in backbone.weights:
        weight.value.block_until_ready()
    seconds = time.perf_counter() - start
    peak, final = _device_memory()
    return dict(
        seconds=seconds,
        peak_bytes=peak,
        final_bytes=final,
        params=backbone.count_params(),
        variable_dtype=str(backbone.weights[0].dtype),
    )


def _train_step_seconds(lm, x, y, count) -> list[float]:
    """Seconds of each of `count` `train_on_batch` calls, each waited for."""
    import jax

    times = []
    for _ in range(count):
        start = time.perf_counter()
        logs = lm.train_on_batch(x, y, return_dict=True)
        jax.block_until_ready(logs["loss"])
        times.append(time.perf_counter() - start)
    return times


def child_train(path, variant, lora_rank, batch, seq, steps, warmup, generate):
    """One training step's speed and device peak, in this fresh process.

    `variant` is "keras-hub" (plain `from_preset`) or "autodist" (a
    one-device mesh); "autodist+check" also compiles the step first with
    `compiled_memory` on this device (the local compile) and records its
    figures beside the closed forms. `lora_rank` 0 trains every weight."""
    import jax
    import keras
    import keras_hub
    import numpy as np

    import keras_hub_autodist
    from keras_hub_autodist.fitting import step_memory

    row = {}
    lora_rank = lora_rank or None
    kwargs = dict(preprocessor=None, dtype="bfloat16")
    if variant.startswith("autodist"):
        devices = keras.distribution.list_devices()[:1]
        mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
        plan = keras_hub_autodist.plan(
            path, mesh, dtype="bfloat16", lora_rank=lora_rank
        )
        if variant == "autodist+check":
            start = time.perf_counter()
            compiled = keras_hub_autodist.compiled_memory(plan, batch, seq, "adam")
            row["compiled_check_s"] = time.perf_counter() - start
            row["compiled_peak_bytes"] = compiled.peak_bytes
            row["compiled"] = {
                k: v for k, v in vars(compiled).items() if k.endswith("_bytes")
            }
        row["closed_form_bytes"] = plan.training_bytes_per_device(
            "adam"
        ) + plan.activation_bytes_per_device(batch, seq)
        row["calibrated_bytes"] = step_memory.step_estimate(
            plan, batch, seq, "adam", platform=jax.devices()[0].platform
        ).total_bytes
        kwargs["device_mesh"] = mesh
    lm = keras_hub.models.GemmaCausalLM.from_preset(path, **kwargs)
    if lora_rank:
        lm.backbone.enable_lora(lora_rank)
    # The task's default loss and metrics, as the compiled check compiles.
    lm.compile(optimizer=keras.optimizers.Adam(1e-5))
    vocabulary = lm.backbone.vocabulary_size
    ids = np.random.default_rng(0).integers(1, vocabulary, (batch, seq))
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids, "int32")}
    y = np.roll(x["token_ids"], -1, axis=1)
    times = _train_step_seconds(lm, x, y, warmup + steps)
    peak, final = _device_memory()
    step = statistics.median(times[warmup:])
    params = lm.backbone.count_params()
    tokens = batch * seq / step
    row.update(
        first_step_s=times[0],
        step_s=step,
        tokens_per_s=tokens,
        tflops=6 * params * tokens / 1e12,
        params=params,
        peak_bytes=peak,
        final_bytes=final,
    )
    if not generate:
        return row
    prompt_length = 8
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :prompt_length] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    length = prompt_length + generate
    lm.compile(sampler="greedy")
    lm.generate(prompt, max_length=length, stop_token_ids=None)  # compile
    start = time.perf_counter()
    lm.generate(prompt, max_length=length, stop_token_ids=None)
    row["generate_tokens_per_s"] = batch * generate / (time.perf_counter() - start)
    return row


def _attention_kernels(dump: pathlib.Path) -> list[str]:
    """The fused attention kernels XLA called in the optimized programs it
    dumped: cuDNN's (`__cudnn$fmha...`) by custom-call target, else none."""
    found = set()
    for path in dump.glob("*after_optimizations*.txt"):
        for word in path.read_text(errors="replace").split('"'):
            if word.startswith("__cudnn$fmha") or "flash" in word.lower():
                found.add(word)
    return sorted(found)


def child_long(path, variant, seq, steps):
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
    lm = keras_hub.models.GemmaCausalLM.from_preset(path, **kwargs)
    lm.backbone.enable_lora(8)
    lm.compile(optimizer=keras.optimizers.Adam(1e-5))
    ids = np.random.default_rng(0).integers(1, 1000, (1, seq)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = np.roll(ids, -1, axis=1)
    times = _train_step_seconds(lm, x, y, 1 + steps)
    peak, final = _device_memory()
    return dict(
        first_step_s=times[0],
        step_s=statistics.median(times[1:]),
        tokens_per_s=seq / statistics.median(times[1:]),
        peak_bytes=peak,
        final_bytes=final,
        attention_kernels=_attention_kernels(dump),
    )


def child_attention(variant, queries, keys, heads, kv_heads, head_dim, repeats):
    """Causal attention alone, forward and backward, in bfloat16: `queries`
    (the last of the sequence) against `keys`. `variant` "cudnn" and "xla"
    are `jax.nn.dot_product_attention`'s implementations; "blockwise" is the
    per-device attention of the context axis
    (`attention.blockwise_attention`). Median seconds and device peak."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q = normal(1, queries, heads, head_dim)
    k = normal(1, keys, kv_heads, head_dim)
    v = normal(1, keys, kv_heads, head_dim)
    scale = head_dim**-0.5
    if variant == "blockwise":
        from keras_hub_autodist.attention import blockwise_attention as blockwise

        rule = blockwise.AttentionRule(scale=scale)
        query_positions = jnp.arange(keys - queries, keys, dtype=jnp.int32)
        key_positions = jnp.arange(keys, dtype=jnp.int32)
        valid = jnp.ones((1, keys), bool)
        groups = heads // kv_heads

        def attend(q, k, v):
            grouped = q.reshape(1, queries, kv_heads, groups, head_dim)
            out = blockwise.blockwise_attention(
                rule, grouped, k, v, query_positions, key_positions, valid
            )
            return out.reshape(1, queries, heads, head_dim)
    else:
        if queries != keys:
            raise SystemExit("cudnn and xla variants attend a whole sequence")

        def attend(q, k, v):
            return jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, implementation=variant
            )

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
    peak, _ = _device_memory()
    text = step.lower(q, k, v).compile().as_text()
    return dict(
        compile_s=compile_s,
        step_s=statistics.median(times),
        peak_bytes=peak,
        fused=sorted({w for w in text.split('"') if w.startswith("__cudnn$fmha")}),
    )


def _child_main(argv):
    _setup_child()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = _child_row(*argv)
    # Python warnings raised during the measurement (Keras' sharding
    # warnings among them), each once.
    row["warnings"] = sorted(
        {f"{w.category.__name__}: {w.message}"[:300] for w in caught}
    )
    print(json.dumps(row))


def _child_row(kind, *args):
    if kind == "load":
        path, variant, dtype = args
        row = child_load(path, None if variant == "-" else variant, _none(dtype))
    elif kind == "attention":
        variant, *sizes = args
        row = child_attention(variant, *map(int, sizes))
    elif kind == "long":
        path, variant, seq, steps = args
        row = child_long(path, variant, int(seq), int(steps))
    elif kind == "train":
        path, variant, *sizes = args
        row = child_train(path, variant, *map(int, sizes))
    else:
        raise SystemExit(f"unknown child {kind!r}")
    return row


def _none(text):
    return None if text == "-" else text


def _run_child(*args, timeout=600, dump=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if dump is not None:  # the optimized programs, to read the kernels off
        env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
        env["BENCH_XLA_DUMP"] = str(dump)
    root = pathlib.Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), env.get("PYTHONPATH", "")) if p
    )
    result = subprocess.run(
        [sys.executable, "-m", "bench.accelerator", "--child", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=root,
    )
    if result.returncode:
        return dict(error=result.stderr.strip().splitlines()[-1:] or ["failed"])
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the run --------------------------------------------------------------------


def _nvidia_smi(query: str) -> list[str]:
    """`nvidia-smi --query-gpu=<query>`'s lines, one per GPU; [] without it."""
    if not shutil.which("nvidia-smi"):
        return []
    found = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip().splitlines() if found.returncode == 0 else []


def machine() -> str:
    """The accelerator's name and memory (`nvidia-smi`), else JAX's device
    kind, else the CPU."""
    lines = _nvidia_smi("name,memory.total")
    if lines:
        return f"{len(lines)} x {lines[0].strip()}"
    try:
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            return f"{len(jax.devices())} x {device.device_kind}"
    except Exception:  # noqa: BLE001 - any JAX failure: name the CPU instead
        pass
    cpu = platform.processor() or platform.machine()
    return f"CPU only: {cpu}, {os.cpu_count()} cores"


def make_preset(root, name, config):
    """A GemmaBackbone preset with random bfloat16 weights, saved by keras-hub."""
    code = (
        "import os; os.environ['KERAS_BACKEND'] = 'jax'\n"
        "import keras, keras_hub, json, sys\n"
        "keras.utils.set_random_seed(0)\n"
        "config = json.loads(sys.argv[2])\n"
        "keras_hub.models.GemmaBackbone(**config, dtype='bfloat16')"
        ".save_to_preset(sys.argv[1])\n"
    )
    path = os.path.join(root, name)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, path, json.dumps(config)], check=True, env=env
    )
    return path, time.perf_counter() - start


def versions() -> dict:
    """The driver's, JAX's, Keras' and keras-hub's versions on this machine."""
    found = {}
    drivers = _nvidia_smi("driver_version")
    if drivers:
        found["driver"] = drivers[0].strip()
    from importlib import metadata

    for name in (
        "jax",
        "jaxlib",
        "keras",
        "keras-hub",
        "jax-cuda13-plugin",
        "jax-cuda12-plugin",
    ):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def _train_rows(path, step, results, save):
    variants = (["keras-hub"] if step.pair else []) + [
        "autodist+check" if step.local_check else "autodist"
    ]
    for variant in variants:
        print(f"train: {step.name}, {variant}", flush=True)
        row = _run_child(
            "train",
            path,
            variant,
            step.lora_rank,
            step.batch,
            step.sequence,
            step.steps,
            step.warmup,
            step.generate,
        )
        label = variant.split("+")[0]
        results["training"].append(dict(step=step.name, variant=label, **row))
        save()


def _long_rows(path, folder, tiny, results, save):
    for seq in LONG_SEQUENCES_TINY if tiny else LONG_SEQUENCES:
        for variant in ("keras-hub", "autodist"):
            print(f"long context: {seq} tokens, {variant}", flush=True)
            dump = pathlib.Path(folder) / f"dump-{variant}-{seq}"
            row = _run_child("long", path, variant, seq, 2, dump=dump)
            shutil.rmtree(dump, ignore_errors=True)
            results["long_context"].append(dict(variant=variant, seq=seq, **row))
            save()


def _attention_rows(tiny, results, save):
    heads, kv_heads, head_dim = (4, 1, 16) if tiny else (8, 1, 256)
    for variant, queries, keys in ATTENTION_CASES_TINY if tiny else ATTENTION_CASES:
        print(f"attention: {variant}, {queries} x {keys}", flush=True)
        row = _run_child(
            "attention", variant, queries, keys, heads, kv_heads, head_dim, 5
        )
        results["attention"].append(
            dict(
                variant=variant,
                queries=queries,
                keys=keys,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                **row,
            )
        )
        save()


def run(tiny=False, root=None, out=None, parts=PARTS):
    """Make the presets and measure `parts` (of `PARTS`); the results
    are saved to `out/accelerator.json` after every row, so that a run cut
    short keeps what it measured."""
    started = time.perf_counter()
    results = dict(
        machine=machine(),
        versions=versions(),
        date=datetime.date.today().isoformat(),
        tiny=tiny,
        loading=[],
        training=[],
        long_context=[],
        attention=[],
    )

    def save():
        results["elapsed_s"] = time.perf_counter() - started
        if out is not None:
            (out / "accelerator.json").write_text(json.dumps(results, indent=1))

    steps = accelerator_steps.steps_of(tiny)
    with tempfile.TemporaryDirectory(dir=root) as folder:
        for shape, config in (("7b", GEMMA_7B), ("2b", GEMMA_2B)):
            if not set(parts) & PRESET_PARTS[shape]:
                continue
            path, results[f"save_{shape}_s"] = make_preset(
                folder, f"gemma_{shape}_shape", TINY if tiny else config
            )
            if shape == "7b" and "load" in parts:
                for label, variant, dtype in LOAD_VARIANTS:
                    print(f"load: {label}, dtype={dtype}", flush=True)
                    row = _run_child("load", path, variant or "-", dtype or "-")
                    results["loading"].append(dict(variant=label, dtype=dtype, **row))
                    save()
            if "train" in parts:
                for step in steps:
                    if step.shape == shape:
                        _train_rows(path, step, results, save)
            if shape == "2b" and "long" in parts:
                _long_rows(path, folder, tiny, results, save)
            shutil.rmtree(path)
    if "attention" in parts:
        _attention_rows(tiny, results, save)
    save()
    return results


# --- the report -------------------------------------------------------------------


def _gb(n):
    """Bytes in GB, or MB below 0.1 GB (`--tiny`)."""
    if n is None:
        return ""
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"


def _failure(row) -> str:
    """A failed measurement's error as a Markdown cell: in a code span, so
    that its brackets are not read as links, without the table's bars."""
    text = " ".join(row["error"]).replace("`", "'").replace("|", "/")
    return f"fails: `{text}`"


def _ratio(a, b):
    return "" if not a or not b else f"{a / b:.2f}"


def _dtype_label(row):
    if row["variant"] == "raw read":
        return "(bfloat16 file)"
    return row["dtype"] or "none (float32 model)"


def render(results, predictions=None) -> str:
    """The section "On one accelerator" of docs/benchmarks.md, as Markdown.

    `predictions` are the target compile's figures per step, made on a CPU
    machine before the run (`accelerator_steps.read_predictions`)."""
    predictions = predictions or {}
    shapes = "tiny shapes (`--tiny`)" if results["tiny"] else "Gemma 7B / 2B shapes"
    found = ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())
    lines = [
        "## On one accelerator",
        "",
        f"{results['machine']}, {results['date']}; {found}; {shapes}; "
        f"`python -m bench --accelerator` {_runs(results)}. "
        "Random bfloat16 weights saved by keras-hub; each measurement in a "
        "fresh process; device bytes from `memory_stats()` (empty where the "
        "device keeps none).",
        "",
        "### Loading (`Backbone.from_preset`, Gemma 7B shape)",
        "",
        "| variant | dtype= | s | device peak | final | peak / final |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["loading"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['dtype']} | {_failure(r)} | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {_dtype_label(r)} | "
            f"{r['seconds']:.2f} | {_gb(r.get('peak_bytes'))} | "
            f"{_gb(r.get('final_bytes'))} | "
            f"{_ratio(r.get('peak_bytes'), r.get('final_bytes'))} |"
        )
    warned = sorted(
        {
            w
            for r in results["loading"]
            if r["variant"] == "autodist"
            for w in r.get("warnings", [])
        }
    )
    lines += [
        "",
        "Python warnings during autodist's loads: "
        + ("; ".join(f"`{w}`" for w in warned) if warned else "none."),
    ]
    lines += [
        "",
        "### Training (bfloat16, Adam, `train_on_batch`, one device)",
        "",
        "Median of the timed steps after warm-up; TFLOP/s counted as 6 x "
        "parameters x tokens (LoRA steps: the whole model's parameters, so an "
        "upper bound); generate: greedy, new tokens per second.",
        "",
        "| step | variant | s/step | tokens/s | TFLOP/s | first step s | "
        "device peak | generate tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["training"]:
        if "error" in r:
            lines.append(f"| {r['step']} | {r['variant']} | {_failure(r)} | | | | | |")
            continue
        generated = r.get("generate_tokens_per_s")
        lines.append(
            f"| {r['step']} | {r['variant']} | {r['step_s']:.4f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
            f"{r['first_step_s']:.1f} | {_gb(r.get('peak_bytes'))} | "
            f"{'' if generated is None else f'{generated:,.0f}'} |"
        )
    lines += _memory_table(results, predictions)
    lines += _long_table(results)
    lines += _attention_table(results)
    lines += accelerator_targets.table(results, predictions)
    return "\n".join(lines) + "\n"


def _attention_table(results) -> list[str]:
    rows = results.get("attention") or []
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        "### Attention alone (causal, bfloat16, forward and backward)",
        "",
        f"{first['heads']} query heads, {first['kv_heads']} key/value head, "
        f"head_dim {first['head_dim']}, batch 1; the last `queries` of a "
        "sequence of `keys` tokens. cudnn and xla: "
        "`jax.nn.dot_product_attention`'s implementations over a whole "
        "sequence; blockwise: the context axis' per-device attention (at "
        "queries = keys / 8, one device's share of a context axis of 8).",
        "",
        "| variant | queries x keys | s | device peak | compile s | fused kernels |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['queries']} x {r['keys']}"
        if "error" in r:
            lines.append(f"| {r['variant']} | {size} | {_failure(r)} | | | |")
            continue
        kernels = ", ".join(f"`{k}`" for k in r["fused"]) or "none"
        lines.append(
            f"| {r['variant']} | {size} | {r['step_s']:.4f} | "
            f"{_gb(r.get('peak_bytes'))} | {r['compile_s']:.1f} | {kernels} |"
        )
    return lines


def _long_table(results) -> list[str]:
    rows = results.get("long_context") or []
    if not rows:
        return []
    lines = [
        "",
        "### Long context (Gemma 2B shape, LoRA 8, one sequence, bfloat16)",
        "",
        "The fused attention kernel is read from the optimized programs XLA "
        "dumped on the device (`--xla_dump_to`): cuDNN's custom calls are "
        "named `__cudnn$fmha...`; none listed means XLA's own attention.",
        "",
        "| tokens | variant | s/step | tokens/s | first step s | device peak "
        "| fused attention kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['variant']} | {_failure(r)} | | | | |")
            continue
        kernels = ", ".join(f"`{k}`" for k in r["attention_kernels"]) or "none"
        lines.append(
            f"| {r['seq']} | {r['variant']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['first_step_s']:.1f} | "
            f"{_gb(r.get('peak_bytes'))} | {kernels} |"
        )
    return lines


def _runs(results) -> str:
    """How long the run took, or each of the runs whose parts were merged."""
    runs = results.get("runs")
    if not runs:
        return f"in {results['elapsed_s']:.0f} s"
    return "in {} runs ({})".format(
        len(runs),
        "; ".join(f"`--parts {r['parts']}` {r['elapsed_s']:.0f} s" for r in runs),
    )


def _memory_table(results, predictions) -> list[str]:
    """Each autodist step's measured peak against the answers given before
    it ran: the target compile (on a CPU machine), the local compile (on the
    device), the plan's closed form and the calibrated one."""
    rows = [
        r
        for r in results["training"]
        if r["variant"] == "autodist" and "error" not in r
    ]
    if not rows:
        return []
    lines = [
        "",
        "### Memory answers against the measured peak (autodist's steps)",
        "",
        "Each answer as bytes and as a ratio to the device's measured peak. "
        "Target compile: the step compiled for this accelerator on a CPU-only "
        "machine before the run (`bench/predictions/`); local compile: "
        "`compiled_memory` on the device itself.",
        "",
        "| step | measured peak | target compile | local compile | closed form "
        "| calibrated closed form |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = r.get("peak_bytes")
        predicted = predictions.get(r["step"], {})

        def cell(value, peak=peak):
            if not value:
                return ""
            return f"{_gb(value)} ({_ratio(value, peak)})"

        lines.append(
            f"| {r['step']} | {_gb(peak)} | "
            f"{cell(predicted.get('target_peak_bytes'))} | "
            f"{cell(r.get('compiled_peak_bytes'))} | "
            f"{cell(r.get('closed_form_bytes'))} | "
            f"{cell(r.get('calibrated_bytes'))} |"
        )
    return lines


def insert(markdown: pathlib.Path, section: str) -> None:
    """Put `section` in `markdown`, replacing an earlier one of the same title."""
    text = markdown.read_text() if markdown.exists() else ""
    title = section.splitlines()[0]
    if title in text:
        before, rest = text.split(title, 1)
        after = rest.find("\n## ")
        text = before + section + (rest[after + 1 :] if after >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    markdown.write_text(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.accelerator")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder")
    parser.add_argument("--insert", default=None, help="a Markdown file to update")
    parser.add_argument("--tmp", default=None, help="where to write the presets")
    parser.add_argument(
        "--parts",
        default="load,train,long,attention",
        help="comma-separated: load, train, long, attention",
    )
    parser.add_argument(
        "--target", default="h200", help="whose committed predictions to report"
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="TARGET",
        help="compile the steps for TARGET on this machine and save the "
        "predictions (bench/predictions/), instead of measuring",
    )
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="render a saved accelerator.json instead of measuring",
    )
    args = parser.parse_args(argv)
    if args.predict:
        print(accelerator_steps.write_predictions(args.predict, args.tiny))
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = json.loads(pathlib.Path(args.render).read_text())
    else:
        parts = tuple(args.parts.split(","))
        results = run(tiny=args.tiny, root=args.tmp, out=out, parts=parts)
    predictions = accelerator_steps.read_predictions(args.target, results["tiny"])
    section = render(results, predictions)
    (out / "accelerator.md").write_text(section)
    if args.insert:
        insert(pathlib.Path(args.insert), section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
