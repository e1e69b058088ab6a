"""The run of `python -m bench --accelerator`: make the presets, run each
measurement in a fresh process, keep to each part's time, save as it goes.

The parent never opens the device (a TPU chip serves one process at a
time): the presets are made on the host's CPU (`JAX_PLATFORMS=cpu`), all at
once in the background while the first measurements run, and the machine
is named by a child (`probe`).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench import accelerator_choices as choices
from bench import accelerator_steps

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOAD_VARIANTS = [
    ("raw read", None, None),
    ("keras-hub", "keras-hub", "bfloat16"),
    ("autodist", "autodist", "bfloat16"),
    ("keras-hub", "keras-hub", None),
    ("autodist", "autodist", None),
]
# The longest any one child may run, and what it may run past its part's
# time (a child started inside it finishes, within this).
CHILD_LIMIT_S = 540
CHILD_GRACE_S = 90


def _child_env(dump=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if dump is not None:  # the optimized programs, to read the kernels off
        env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
        env["BENCH_XLA_DUMP"] = str(dump)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def parse_child_output(stdout: str) -> list[dict]:
    """The JSON lines a child printed, in order (other lines skipped).

    Example:
    >>> parse_child_output('noise\\n{"batch": 4}\\n{"done": true}\\n')
    [{'batch': 4}, {'done': True}]
    """
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run_child(*args, timeout=CHILD_LIMIT_S, dump=None) -> list[dict]:
    """Run `python -m bench.accelerator --child ARGS` and return its JSON
    lines; the last is `{"error": [...]}` when it failed or ran out of time
    (the lines printed before are kept)."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "bench.accelerator", "--child", *map(str, args)],
            capture_output=True,
            text=True,
            env=_child_env(dump),
            timeout=max(timeout, 1),
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        rows = [r for r in parse_child_output(out) if not r.get("done")]
        return rows + [dict(error=[f"stopped at the time limit ({timeout:.0f} s)"])]
    rows = parse_child_output(result.stdout)
    if result.returncode or not rows or not rows[-1].get("done"):
        tail = result.stderr.strip().splitlines()[-1:] or ["failed"]
        return [r for r in rows if not r.get("done")] + [dict(error=tail)]
    return rows


def _result(rows: list[dict]) -> dict:
    """A one-result child's row: its last line, without the end marker."""
    row = dict(rows[-1])
    row.pop("done", None)
    return row


class Presets:
    """The run's presets, made one after another in the background on the
    host's CPU, in the order the measurements need them.

    One at a time: making a preset holds its model in float32 for a
    moment, and three at once (a load part beside two models) ran the TPU
    machine's 40 GiB of host memory out.
    """

    def __init__(self, folder: str, models: list[str], tiny: bool):
        self.paths = {}
        self.seconds = {}
        self.errors = {}
        self._made = {model: threading.Event() for model in models}
        self._job = None
        self._closed = False
        for model in models:
            self.paths[model] = os.path.join(folder, f"{model}_shape")
        self._maker = threading.Thread(
            target=self._make_all, args=(models, tiny), daemon=True
        )
        self._maker.start()

    def _make_all(self, models: list[str], tiny: bool):
        code = (
            "import os; os.environ['KERAS_BACKEND'] = 'jax'\n"
            "import keras, keras_hub, json, sys\n"
            "keras.utils.set_random_seed(0)\n"
            "cls = getattr(keras_hub.models, sys.argv[2])\n"
            "cls(**json.loads(sys.argv[3]), dtype='bfloat16')"
            ".save_to_preset(sys.argv[1])\n"
        )
        env = _child_env()
        env["JAX_PLATFORMS"] = "cpu"  # the device is the children's
        for model in models:
            if self._closed:
                break
            class_name, config = accelerator_steps.model_config(model, tiny)
            started = time.perf_counter()
            self._job = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    self.paths[model],
                    class_name,
                    json.dumps(config),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, err = self._job.communicate()
            self.seconds[model] = time.perf_counter() - started
            if self._job.returncode:
                self.errors[model] = err.strip()[-500:]
            self._made[model].set()

    def path(self, model: str) -> str | None:
        """The preset of `model`, once made; None where making it failed."""
        if model not in self._made:
            return None
        self._made[model].wait()
        if model in self.errors:
            print(f"preset {model} failed: {self.errors.pop(model)}", flush=True)
            self.paths[model] = None
        return self.paths.get(model)

    def close(self):
        self._closed = True
        if self._job is not None and self._job.poll() is None:
            self._job.kill()
        self._maker.join(timeout=30)


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


def machine(probe: dict) -> str:
    """The accelerator's name and memory (`nvidia-smi`), else the probed
    device's kind and program memory, else the CPU."""
    lines = _nvidia_smi("name,memory.total")
    if lines:
        return f"{len(lines)} x {lines[0].strip()}"
    if probe.get("platform") not in (None, "cpu"):
        limit = probe.get("bytes_limit")
        memory = f", {limit / 2**30:.2f} GiB per program" if limit else ""
        return f"{probe['devices']} x {probe['device_kind']}{memory}"
    cpu = platform.processor() or platform.machine()
    return f"CPU only: {cpu}, {os.cpu_count()} cores"


def versions() -> dict:
    """The driver's, JAX's, libtpu's, Keras' and keras-hub's versions."""
    from importlib import metadata

    found = {}
    drivers = _nvidia_smi("driver_version")
    if drivers:
        found["driver"] = drivers[0].strip()
    for name in (
        "jax",
        "jaxlib",
        "libtpu",
        "libtpu-nightly",
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


class Clock:
    """Each part's time and the run's: the family's times
    (`choices.BUDGET_S`) of the parts run, stretched to fill the run's
    (`choices.TOTAL_S`) where fewer parts run, all times `scale`."""

    def __init__(self, family: str, parts, scale: float):
        budgets = choices.BUDGET_S[family]
        total = choices.TOTAL_S[family]
        asked = [budgets.get(p) for p in parts]
        stretch = 1.0
        if total is not None and None not in asked and sum(asked):
            stretch = max(1.0, total / sum(asked))
        self.budgets = {
            p: None if budgets.get(p) is None else budgets[p] * stretch * scale
            for p in parts
        }
        self.total_s = None if total is None else total * scale
        self.started = time.perf_counter()
        self.part_end = None

    def start_part(self, part: str) -> None:
        budget = self.budgets.get(part)
        now = time.perf_counter()
        self.part_end = None if budget is None else now + budget

    def left(self) -> float | None:
        """Seconds left to start a measurement in; None: no limit."""
        now = time.perf_counter()
        ends = [self.part_end] if self.part_end is not None else []
        if self.total_s is not None:
            ends.append(self.started + self.total_s)
        return None if not ends else min(ends) - now

    def child_limit(self) -> float:
        left = self.left()
        return (
            CHILD_LIMIT_S if left is None else min(CHILD_LIMIT_S, left + CHILD_GRACE_S)
        )


def _skip(clock, results, what) -> bool:
    """Whether the part's time is spent: then `what` is listed as skipped."""
    left = clock.left()
    if left is not None and left <= 0:
        results["skipped"].append(what)
        print(f"skipped (out of time): {what}", flush=True)
        return True
    return False


def _train_child(step, path, variant, clock, timing_only=False) -> list[dict]:
    """`step`'s ladder trained by `variant` in a fresh process
    (`accelerator_training.child_train`); `timing_only` leaves out its
    `generate` timing and its local compile."""
    generate, local_check = (0, 0) if timing_only else (step.generate, step.local_check)
    return run_child(
        "train",
        path,
        variant,
        step.lora_rank,
        ",".join(map(str, step.batches)),
        step.sequence,
        step.steps,
        step.warmup,
        generate,
        int(local_check),
        step.remat or "-",
        timeout=clock.child_limit(),
    )


def _train(step, path, clock, results, save):
    variants = (
        (["keras-hub"] if step.pair else [])
        + (["autodist-xla"] if step.against_xla else [])
        + ["autodist"]
    )
    # autodist first: the package's own rows matter most if time runs out.
    for variant in reversed(variants):
        what = f"train {step.label} {variant}"
        if path is None:
            results["training"].append(
                dict(
                    step=step.name(step.batches[0]),
                    variant=variant,
                    error=["no preset"],
                )
            )
            continue
        if _skip(clock, results, what):
            continue
        print(f"{what}: batches {step.batches}", flush=True)
        rows = _train_child(step, path, variant, clock)
        rungs, generated = [], {}
        for row in rows:
            if "generate_tokens_per_s" in row and "load_s" not in row:
                generated[row["batch"]] = row["generate_tokens_per_s"]
            elif not row.get("done"):
                rungs.append(row)
        for i, row in enumerate(rungs):
            # A failure's row (no batch) is the rung after the last measured.
            batch = row.get("batch") or step.batches[min(i, len(step.batches) - 1)]
            if batch in generated:
                row["generate_tokens_per_s"] = generated[batch]
            results["training"].append(
                dict(step=step.name(batch), label=step.label, variant=variant, **row)
            )
        save()


def speed_order(rounds: int) -> list[tuple[int, str]]:
    """`(round, variant)` in the order the part `speed` runs them: each
    round pairs keras-hub and autodist, in turns first.

    Example:
    >>> speed_order(2)
    [(0, 'keras-hub'), (0, 'autodist'), (1, 'autodist'), (1, 'keras-hub')]
    """
    pair = ["keras-hub", "autodist"]
    return [
        (i, variant)
        for i in range(rounds)
        for variant in (pair if i % 2 == 0 else pair[::-1])
    ]


def _speed(step, path, clock, results, save):
    """The part `speed`: `step`'s batches in `SPEED_ROUNDS` alternated
    pairs of processes, `train_on_batch` and `fit` timed in each."""
    for round_, variant in speed_order(accelerator_steps.SPEED_ROUNDS):
        what = f"speed {step.label} {variant} round {round_}"
        if path is None or _skip(clock, results, what):
            continue
        print(f"{what}: batches {step.batches}", flush=True)
        rows = _train_child(step, path, variant, clock, timing_only=True)
        for row in (r for r in rows if not r.get("done")):
            batch = row.get("batch") or step.batches[0]
            results["speed"].append(
                dict(
                    step=step.name(batch),
                    label=step.label,
                    variant=variant,
                    round=round_,
                    **row,
                )
            )
        save()


def _chunks(step, path, clock, results, save):
    """The part `chunks`: a process per batch of `step`, largest first (its
    logits are cut most), each timing every chunk rule in turn
    (`accelerator_chunks.child_chunks`)."""
    for batch in sorted(step.batches, reverse=True):
        what = f"chunks {step.name(batch)}"
        if path is None or _skip(clock, results, what):
            continue
        print(what, flush=True)
        rows = run_child(
            "chunks",
            path,
            step.lora_rank,
            batch,
            step.sequence,
            step.steps,
            step.warmup,
            timeout=clock.child_limit(),
        )
        for row in (r for r in rows if not r.get("done")):
            results["chunks"].append(dict(step=step.name(batch), **row))
        save()


def probe() -> dict:
    """The machine's device, read by a child (`child_probe`): platform
    "cpu" where the child failed."""
    row = _result(run_child("probe", timeout=180))
    if "error" in row:
        print(f"probe failed: {row['error']}", flush=True)
        return dict(platform="cpu", device_kind="cpu", devices=1, **row)
    return row


def run(
    target,
    tiny=False,
    root=None,
    out=None,
    parts=None,
    scale=1.0,
    probed=None,
    models=None,
    labels=None,
):
    """Make the presets and measure `parts` (the target family's by
    default) for `target`; the results are saved to `out/accelerator.json`
    after every measurement, so that a run cut short keeps what it
    measured. `probed` is the machine's device where already read;
    `models` (keys of `accelerator_steps.MODELS`) keeps the steps of those
    models alone, and `labels` (`Step.label`) the steps so labelled, in
    every part."""

    def chosen(candidates):
        return accelerator_steps.chosen(candidates, models, labels)

    family = choices.family_of(target)
    parts = parts or choices.PARTS[family]
    clock = Clock(family, parts, scale)
    load_model = choices.LOAD_MODEL[family]
    steps = chosen(accelerator_steps.steps_of(family, tiny) if "train" in parts else [])
    speed_steps = chosen(
        accelerator_steps.speed_steps_of(family, tiny) if "speed" in parts else []
    )
    chunk_steps = chosen(
        accelerator_steps.chunk_steps_of(family, tiny) if "chunks" in parts else []
    )
    results = dict(
        versions=versions(),
        date=datetime.date.today().isoformat(),
        tiny=tiny,
        target=target,
        family=family,
        parts=list(parts),
        models=None if models is None else list(models),
        labels=None if labels is None else list(labels),
        load_model=load_model,
        loading=[],
        training=[],
        long_context=[],
        attention=[],
        speed=[],
        chunks=[],
        skipped=[],
    )

    def save():
        results["elapsed_s"] = time.perf_counter() - clock.started
        if out is not None:
            (out / "accelerator.json").write_text(json.dumps(results, indent=1))

    long_steps = chosen(
        accelerator_steps.long_steps_of(family, tiny) if "long" in parts else []
    )
    search_steps = chosen(
        accelerator_steps.search_steps_of(family, tiny) if "search" in parts else []
    )
    needed = [step.model for step in steps + speed_steps + chunk_steps + search_steps]
    if "load" in parts:
        needed.append(load_model)
    if "long" in parts:
        needed += [step.model for step in long_steps] or ["gemma_2b"]
    with tempfile.TemporaryDirectory(dir=root) as folder:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(folder, "xla"))
        presets = Presets(folder, list(dict.fromkeys(needed)), tiny)
        try:
            # Read while the presets are made, unless read already.
            probed = probed or probe()
            results["probe"] = probed
            results["machine"] = machine(probed)
            save()
            for part in parts:
                clock.start_part(part)
                if part == "train":
                    for step in steps:
                        _train(step, presets.path(step.model), clock, results, save)
                elif part == "load":
                    _load(presets.path(load_model), clock, results, save)
                elif part == "long" and long_steps:
                    for step in long_steps:
                        _train(step, presets.path(step.model), clock, results, save)
                elif part == "long":
                    _long(
                        presets.path("gemma_2b"),
                        family,
                        folder,
                        tiny,
                        clock,
                        results,
                        save,
                    )
                elif part == "search":
                    for step in search_steps:
                        _train(step, presets.path(step.model), clock, results, save)
                elif part == "attention":
                    _attention(family, tiny, clock, results, save)
                elif part == "speed":
                    for step in speed_steps:
                        _speed(step, presets.path(step.model), clock, results, save)
                elif part == "chunks":
                    for step in chunk_steps:
                        _chunks(step, presets.path(step.model), clock, results, save)
        finally:
            presets.close()
        results["preset_s"] = presets.seconds
    save()
    return results


def _load(path, clock, results, save):
    for label, variant, dtype in LOAD_VARIANTS:
        what = f"load {label} dtype={dtype}"
        if path is None:
            results["loading"].append(
                dict(variant=label, dtype=dtype, error=["no preset"])
            )
            continue
        if _skip(clock, results, what):
            continue
        print(what, flush=True)
        rows = run_child(
            "load", path, variant or "-", dtype or "-", timeout=clock.child_limit()
        )
        results["loading"].append(dict(variant=label, dtype=dtype, **_result(rows)))
        save()


def _long(path, family, folder, tiny, clock, results, save):
    sequences = choices.LONG_SEQUENCES_TINY if tiny else choices.LONG_SEQUENCES[family]
    for seq in sequences:
        for variant in ("keras-hub", "autodist"):
            what = f"long {seq} {variant}"
            if path is None or _skip(clock, results, what):
                continue
            print(what, flush=True)
            dump = pathlib.Path(folder) / f"dump-{variant}-{seq}"
            rows = run_child(
                "long", path, variant, seq, 2, dump=dump, timeout=clock.child_limit()
            )
            shutil.rmtree(dump, ignore_errors=True)
            results["long_context"].append(
                dict(variant=variant, seq=seq, **_result(rows))
            )
            save()


def _attention(family, tiny, clock, results, save):
    heads = choices.ATTENTION_HEADS_TINY if tiny else choices.ATTENTION_HEADS
    for variant, queries, keys in choices.attention_cases(family, tiny):
        what = f"attention {variant} {queries}x{keys}"
        if _skip(clock, results, what):
            continue
        print(what, flush=True)
        rows = run_child(
            "attention", variant, queries, keys, *heads, 5, timeout=clock.child_limit()
        )
        results["attention"].append(
            dict(
                variant=variant,
                queries=queries,
                keys=keys,
                heads=heads[0],
                kv_heads=heads[1],
                head_dim=heads[2],
                **_result(rows),
            )
        )
        save()
