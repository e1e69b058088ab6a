"""The `keras-hub-autodist` command: `plan` a preset on a mesh, or `demo`.

Example:
```
keras-hub-autodist plan ./gemma_2b --mesh batch=2,model=4 --strategy fsdp
keras-hub-autodist demo
```
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"keras-hub-autodist: error: {message}\n")


def parse_mesh(text: str) -> dict[str, int]:
    """Parse `batch=2,model=4` into `{"batch": 2, "model": 4}`.

    Example:
    >>> parse_mesh("model=4,batch=2")
    {'model': 4, 'batch': 2}
    """
    mesh = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"--mesh takes name=size pairs such as batch=2,model=4. "
                f"Received: {text!r}"
            )
        mesh[name.strip()] = int(size)
    return mesh


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="keras-hub-autodist",
        description="Plan and run keras-hub models on a device mesh.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="print a preset's layout on a mesh")
    plan.error = parser.error
    plan.add_argument("preset", help="local folder, hf://…, kaggle://… or name")
    plan.add_argument(
        "--mesh", type=parse_mesh, required=True, help="e.g. batch=2,model=4"
    )
    plan.add_argument("--strategy", default="auto", choices=["auto", "tp", "fsdp"])
    plan.add_argument("--batch-axis", default=None)
    plan.add_argument("--model-axis", default=None)
    plan.add_argument("--dtype", default=None, help="e.g. bfloat16")
    demo = commands.add_parser(
        "demo", help="plan, LoRA fine-tune and generate (embedded tiny Gemma)"
    )
    demo.error = parser.error
    demo.add_argument("--preset", default=None, help="default: embedded tiny Gemma")
    demo.add_argument(
        "--mesh", type=parse_mesh, default=None, help="e.g. batch=2,model=4"
    )
    demo.add_argument("--strategy", default="auto", choices=["auto", "tp", "fsdp"])
    demo.add_argument("--steps", type=int, default=3, help="epochs of fine-tuning")
    return parser


def _run_plan(args) -> int:
    from keras_hub_autodist.plan import plan

    result = plan(
        args.preset,
        args.mesh,
        strategy=args.strategy,
        batch_axis=args.batch_axis,
        model_axis=args.model_axis,
        dtype=args.dtype,
    )
    print(result)
    return 0


def _run_demo(args) -> int:
    from keras_hub_autodist.demo import run_demo

    run_demo(
        preset=args.preset, mesh=args.mesh, strategy=args.strategy, steps=args.steps
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `keras-hub-autodist` command."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.command == "demo":
        from keras_hub_autodist.demo import has_accelerator
        from keras_hub_autodist.demo import use_virtual_cpu_devices

        if not has_accelerator():
            use_virtual_cpu_devices(8)
    from keras_hub_autodist.errors import AutodistError

    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "demo":
            return _run_demo(args)
    except (AutodistError, ValueError, FileNotFoundError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"keras-hub-autodist: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
