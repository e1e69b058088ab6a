"""The `keras-hub-autodist` command: `plan` a preset on a mesh, or `demo`.

`--help` imports nothing but the standard library and this package's light
modules, and planning a local preset folder for a mesh given by axis sizes
imports neither Keras, keras-hub nor JAX (see `keras_hub_autodist.fitting.planner`).
Every error of the package, and the common ones of bad input (missing
files, no network), is printed as one line `keras-hub-autodist: error: ...`
with exit status 2; messages name the command's flags.

Example:
```
keras-hub-autodist plan ./gemma_2b --mesh batch=2,model=4 --strategy fsdp
keras-hub-autodist plan ./gemma_7b --mesh auto --devices 8 --device-memory 40
keras-hub-autodist plan ./gemma_2b --mesh batch=2,model=4 --batch 8 --seq 512 --compiled
keras-hub-autodist plan ./gemma_2b --mesh batch=1 --device v5e --batch 8 --seq 512 \
    --closed-form
keras-hub-autodist demo
```
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Sequence

from keras_hub_autodist import cli_answer
from keras_hub_autodist import cli_search
from keras_hub_autodist.cli_flags import as_flags
from keras_hub_autodist.fitting.device_memory import GIB
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.trained_state import OPTIMIZERS
from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES
from keras_hub_autodist.planning.options import STRATEGY_CHOICES
from keras_hub_autodist.planning.remat_arguments import BLOCK_POLICIES

PROG = "keras-hub-autodist"
EXIT_USAGE = 2
# Errors of bad input that are printed as one line rather than a traceback,
# besides the package's own `AutodistError`s.
USER_ERRORS = (OSError, ValueError, ImportError, OverflowError)
# The most memory `--device-memory` takes per device: 2**50 bytes (1 PiB),
# thousands of times the largest accelerator's; more is a typo (`1e300`).
MAX_DEVICE_MEMORY_GIB = 2**20


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}\n")


def parse_mesh(text: str) -> dict[str, int] | str:
    """Parse `batch=2,model=4` into `{"batch": 2, "model": 4}`; `auto` stays.

    Example:
    >>> parse_mesh("model=4,batch=2")
    {'model': 4, 'batch': 2}
    """
    if text.strip() == "auto":
        return "auto"
    mesh = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not name or not size.isdigit():
            raise argparse.ArgumentTypeError(
                "--mesh takes name=size pairs such as batch=2,model=4, or "
                f"auto. Received: {text!r}"
            )
        if name in mesh:
            raise argparse.ArgumentTypeError(
                f"--mesh names axis {name!r} twice; name each axis once, "
                f"e.g. batch=2,model=4. Received: {text!r}"
            )
        mesh[name] = int(size)
    return mesh


def parse_gib(text: str) -> int:
    """Parse a positive number of GiB (`--device-memory 15.5`) into bytes.

    At most `MAX_DEVICE_MEMORY_GIB` (1 PiB), and at least one byte.

    Example:
    >>> parse_gib("0.5")
    536870912
    """
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not math.isfinite(gib) or gib <= 0:
        raise argparse.ArgumentTypeError(
            "--device-memory takes a positive number of GiB per device, "
            f"e.g. 16 or 15.75. Received: {text!r}"
        )
    if gib > MAX_DEVICE_MEMORY_GIB or int(gib * GIB) < 1:
        raise argparse.ArgumentTypeError(
            "--device-memory takes the memory of one device in GiB, from one "
            f"byte to {MAX_DEVICE_MEMORY_GIB} GiB (1 PiB), e.g. 16 or 15.75. "
            f"Received: {text!r}"
        )
    return int(gib * GIB)


def parse_devices(text: str) -> int:
    """Parse a positive device count (`--devices 8`), at most
    `mesh.MAX_DEVICES`.

    Example:
    >>> parse_devices("8")
    8
    """
    from keras_hub_autodist.planning.mesh import MAX_DEVICES

    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--devices takes a positive number of devices. Received: {text!r}"
        )
    if int(text) > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"--devices takes at most {MAX_DEVICES} (2**20) devices, far more "
            "than any machine has; pass the number of devices the model runs "
            f"on. Received: {text!r}"
        )
    return int(text)


def parse_steps(text: str) -> int:
    """Parse the demo's positive number of fine-tuning steps (`--steps 48`).

    Example:
    >>> parse_steps("48")
    48
    """
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            "--steps takes a positive number of fine-tuning steps (batches), "
            f"e.g. 48. Received: {text!r}"
        )
    return int(text)


def parse_positive(flag: str):
    """A parser of a positive integer for `flag` (`--batch 8`).

    Example:
    >>> parse_positive("--batch")("8")
    8
    """

    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a positive integer. Received: {text!r}"
            )
        return int(text)

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser (no heavy imports).

    Example:
    >>> build_parser().parse_args(["plan", "./p", "--mesh", "batch=2"]).mesh
    {'batch': 2}
    """
    parser = _Parser(
        prog=PROG,
        description="Plan and run keras-hub models on a device mesh.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan",
        help="print a preset's layout on a mesh",
        description=(
            "Print where each weight of a preset goes on a mesh, the "
            "per-device memory, and whether training fits. A local folder "
            "planned for a mesh given by axis sizes needs no devices and "
            "imports neither Keras nor JAX."
        ),
    )
    plan.error = parser.error
    plan.add_argument("preset", help="local folder, hf://…, kaggle://… or name")
    plan.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help=(
            "axis sizes, e.g. batch=2,model=4; or auto: split the devices "
            "(--devices N, else all JAX devices of this machine) as "
            "from_preset(device_mesh='auto') would (required unless --search)"
        ),
    )
    plan.add_argument(
        "--devices",
        type=parse_devices,
        default=None,
        help="with --mesh auto: plan for N devices without asking JAX",
    )
    plan.add_argument("--strategy", default="auto", choices=STRATEGY_CHOICES)
    plan.add_argument("--batch-axis", default=None, help="if not batch/data")
    plan.add_argument("--model-axis", default=None, help="if not model/tensor")
    plan.add_argument(
        "--context-axis",
        default=None,
        help="the axis that splits each sequence, if not context",
    )
    plan.add_argument(
        "--context-parallel-strategy",
        default="all_gather",
        choices=CONTEXT_PARALLEL_STRATEGIES,
        help=(
            "on a context axis: gather each layer's keys and values whole "
            "(all_gather, default) or pass them around it block by block (ring)"
        ),
    )
    plan.add_argument(
        "--dtype",
        default=None,
        help="float16, bfloat16, float32, float64, mixed_float16 or mixed_bfloat16",
    )
    plan.add_argument(
        "--device-memory",
        type=parse_gib,
        default=None,
        metavar="GIB",
        help=(
            "memory per device in GiB (default: "
            "$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB, what the devices report, "
            "or an assumed 16)"
        ),
    )
    plan.add_argument(
        "--batch",
        type=cli_search.parse_batch,
        default=None,
        metavar="B",
        help=(
            "with --seq: estimate a training step of B sequences (auto, with "
            "--search: the largest batch that fits)"
        ),
    )
    plan.add_argument(
        "--per-device-batch",
        type=cli_search.parse_batch_range,
        default=None,
        metavar="LOW:HIGH",
        help=(
            "with --search, instead of --batch: the sequences per device to "
            "try, e.g. 1:16 (both ends and the powers of two between) or 8; "
            "per layout and remat, the largest that fits by its compile"
        ),
    )
    plan.add_argument(
        "--seq",
        type=parse_positive("--seq"),
        default=None,
        metavar="S",
        help="with --batch: tokens per sequence of the training step",
    )
    plan.add_argument(
        "--device",
        default=None,
        choices=sorted(DEVICE_PROFILES),
        help=(
            "plan for the memory JAX can allocate on this device (a v3-8 is 8 "
            "cores), and with --compiled compile for it; not with --device-memory"
        ),
    )
    plan.add_argument(
        "--lora-rank",
        type=parse_positive("--lora-rank"),
        default=None,
        metavar="R",
        help=(
            "plan a LoRA fine-tune of rank R (backbone.enable_lora(R)): only "
            "the LoRA kernels carry gradients and optimizer state"
        ),
    )
    plan.add_argument(
        "--remat",
        default=None,
        choices=list(BLOCK_POLICIES),
        help=(
            "plan the training step with each decoder block recomputed in "
            "the backward pass (from_preset(..., remat=...)): "
            + "; ".join(
                f"{name}: each block keeps {policy.keeps}"
                for name, policy in BLOCK_POLICIES.items()
            )
        ),
    )
    plan.add_argument(
        "--optimizer",
        default="adam",
        choices=list(OPTIMIZERS),
        help="the optimizer of the training step (default adam)",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help=(
            "print one JSON object on stdout (fits, estimate_bytes_per_device, "
            "device_memory_bytes, ...) and nothing else; exit status 0 "
            "whether it fits or not"
        ),
    )
    plan.add_argument(
        "--compiled",
        action="store_true",
        help=(
            "with --batch and --seq: compile the training step for --device "
            "(its compiler: extras tpu-compile, gpu-compile), else for the "
            "local devices; fits is its peak's; nothing is allocated. The "
            "default for a TPU --device when the TPU compiler is installed"
        ),
    )
    plan.add_argument(
        "--closed-form",
        action="store_true",
        help=(
            "answer with the closed form alone, even for a TPU --device whose "
            "compiler is installed (its verdict may be maybe: the TPU "
            "compiler rematerializes when memory is short)"
        ),
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help=(
            "with --device, --devices, --batch (or --per-device-batch) and "
            "--seq: rank the configurations (meshes over batch, model and "
            "context, tp/fsdp, remat, batch per device and gradient "
            "accumulation) by the step compiled for the device, name the "
            "fastest that fits and print the code that trains with it"
        ),
    )
    demo = commands.add_parser(
        "demo", help="plan, LoRA fine-tune and generate (embedded tiny Gemma)"
    )
    demo.error = parser.error
    demo.add_argument("--preset", default=None, help="default: embedded tiny Gemma")
    demo.add_argument(
        "--mesh", type=parse_mesh, default=None, help="e.g. batch=2,model=4"
    )
    demo.add_argument("--strategy", default="auto", choices=STRATEGY_CHOICES)
    demo.add_argument(
        "--steps",
        type=parse_steps,
        default=None,
        help="optimizer steps (batches) of fine-tuning (default 48)",
    )
    return parser


def _run_plan(args) -> int:
    if not args.json:
        answer = cli_answer.answer(args)
        print(answer["text"])
        return 0
    # Everything but the answer goes to stderr, Python's prints and those
    # of native libraries (XLA, TensorFlow) alike.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            answer = cli_answer.answer(args)
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(answer["json"]))
    sys.stdout.flush()
    return 0


def _check_step_flags(args) -> None:
    from keras_hub_autodist.errors import PlanError

    # With --search, --per-device-batch stands for --batch (`cli_search`).
    batch = args.batch if args.per_device_batch is None else args.per_device_batch
    if (batch is None) != (args.seq is None) or (args.compiled and batch is None):
        raise PlanError(
            "A training step's memory needs both --batch and --seq (and "
            "--compiled needs them too), e.g. --batch 8 --seq 2048. "
            f"Received: --batch {args.batch}, --seq {args.seq}"
            + (", --compiled" if args.compiled else "")
        )
    if args.closed_form and (args.compiled or args.search):
        raise PlanError(
            "--closed-form answers without compiling; give either it or "
            "--compiled (and --search, which compiles). Received: --closed-form"
            + (", --compiled" if args.compiled else "")
            + (", --search" if args.search else "")
        )
    if args.device and args.device_memory is not None:
        raise PlanError(
            "--device names a device whose memory the plan takes; give "
            "either it or --device-memory. Received: --device "
            f"{args.device}, --device-memory {args.device_memory / GIB:g}"
        )


def _use_virtual_devices_without_accelerator() -> None:
    from keras_hub_autodist.devices import has_accelerator
    from keras_hub_autodist.devices import use_virtual_cpu_devices

    if not has_accelerator():
        use_virtual_cpu_devices(8)


def _use_virtual_devices_for(mesh, devices: int | None) -> None:
    """Before a step is compiled (`--compiled`, `--search`), without an
    accelerator: JAX on the CPU, whose compile-only stand-ins of a named
    device need no GPU or TPU backend of its own, with as many virtual CPU
    devices as the mesh has (for `--mesh auto` or none, `--devices`, else
    8); before JAX starts."""
    from keras_hub_autodist.devices import has_accelerator
    from keras_hub_autodist.devices import use_virtual_cpu_devices

    if not has_accelerator():
        if isinstance(mesh, dict):
            use_virtual_cpu_devices(math.prod(mesh.values()))
        else:  # --mesh auto, or no mesh (--search)
            use_virtual_cpu_devices(devices or 8)


def _run_demo(args) -> int:
    from keras_hub_autodist.demo import STEPS
    from keras_hub_autodist.demo import run_demo

    run_demo(
        preset=args.preset,
        mesh=args.mesh,
        strategy=args.strategy,
        steps=STEPS if args.steps is None else args.steps,
    )
    return 0


def _prepare_environment() -> None:
    # Before anything imports Keras or TensorFlow: JAX, and no C++ log noise
    # (CUDA driver probes) from TensorFlow when keras-hub imports it.
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _one_line(error: BaseException) -> str:
    text = as_flags(str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


def _closed_pipe() -> int:
    """The reader of stdout went away (`... | head -1`): stop quietly, as the
    Python documentation advises, with stdout sent to devnull so that the
    interpreter's last flush finds no closed pipe either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `keras-hub-autodist` command.

    Returns the exit status: 0; 2 after printing a one-line error; 1, silently,
    when the reader of stdout closed it (`... | head -1`).

    Example:
    ```python
    main(["plan", "./gemma_2b", "--mesh", "batch=2,model=4"])
    ```
    """
    args = build_parser().parse_args(argv)
    _prepare_environment()
    from keras_hub_autodist.errors import AutodistError

    try:
        if args.command == "plan":
            cli_search.check_flags(args)
            _check_step_flags(args)
            if cli_answer.compiles(args) or args.search:
                _use_virtual_devices_for(args.mesh, args.devices)
            status = _run_plan(args)
        else:
            _use_virtual_devices_without_accelerator()
            status = _run_demo(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _closed_pipe()
    except (AutodistError, *USER_ERRORS) as error:
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
