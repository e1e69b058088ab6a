"""`keras-hub-autodist plan PRESET --search`: the layout search from the
command line (`searching.search.search`), as its ranked table or, with
`--json`, as one object (`searching.report.to_json`).

    keras-hub-autodist plan ./llama3_8b --device v5e --devices 8 \\
        --batch 8 --seq 2048 --search [--json]
    keras-hub-autodist plan ./gemma3_1b --device v5e --devices 1 \\
        --per-device-batch 1:16 --seq 2048 --search
"""

from __future__ import annotations

import argparse

from keras_hub_autodist.errors import PlanError


def parse_batch(text: str) -> int | str:
    """`--batch`: a positive integer, or `auto` (with `--search`: the
    largest batch that fits).

    Example:
    >>> parse_batch("8"), parse_batch("auto")
    (8, 'auto')
    """
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"--batch takes a positive integer, or auto with --search. "
            f"Received: {text!r}"
        )
    return int(text)


def parse_batch_range(text: str) -> tuple[int, int]:
    """`--per-device-batch`: `LOW:HIGH` or one positive integer.

    Example:
    >>> parse_batch_range("1:16"), parse_batch_range("8")
    ((1, 16), (8, 8))
    """
    parts = text.strip().split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return (low, high)
    raise argparse.ArgumentTypeError(
        "--per-device-batch takes LOW:HIGH (positive integers, LOW <= HIGH) "
        f"or one positive integer, e.g. 1:16. Received: {text!r}"
    )


def check_flags(args) -> None:
    """Refuse what the search can't take, naming the flag to add or drop.
    Every other flag is the search's: `--strategy` and `--remat` bound the
    candidates, `--context-parallel-strategy` is that of those with a
    context axis, `--dtype`, `--lora-rank` and `--optimizer` shape the step."""
    if not args.search:
        if args.mesh is None:
            raise PlanError(
                "plan needs --mesh (e.g. --mesh batch=2,model=4, or --mesh auto), "
                "or --search. Received: no --mesh"
            )
        if args.batch == "auto":
            raise PlanError(
                "--batch auto asks the layout search for the largest batch that "
                "fits: add --search. Received: --batch auto"
            )
        if args.per_device_batch is not None:
            raise PlanError(
                "--per-device-batch asks the layout search for the fastest batch "
                "per device that fits: add --search (or give --batch). Received: "
                "--per-device-batch {}:{}".format(*args.per_device_batch)
            )
        return
    if args.batch is not None and args.per_device_batch is not None:
        raise PlanError(
            "--search takes a global batch (--batch) or a range per device "
            "(--per-device-batch), not both: drop one. Received: --batch "
            "{}, --per-device-batch {}:{}".format(args.batch, *args.per_device_batch)
        )
    batch = args.batch if args.per_device_batch is None else args.per_device_batch
    missing = [
        flag
        for flag, value in (
            ("--device", args.device),
            ("--devices", args.devices),
            ("--batch (or --per-device-batch)", batch),
            ("--seq", args.seq),
        )
        if value is None
    ]
    if missing:
        raise PlanError(
            "--search ranks layouts of a training step on a named device: it "
            f"needs {', '.join(missing)}, e.g. --device v5e --devices 8 --batch 8 "
            f"--seq 2048. Received: no {', '.join(missing)}"
        )
    if args.mesh not in (None, "auto") or args.compiled:
        raise PlanError(
            "--search chooses the mesh and compiles its candidates itself: drop "
            f"--mesh and --compiled. Received: --mesh {args.mesh}"
            + (", --compiled" if args.compiled else "")
        )
    named = [
        f"{flag} {value}"
        for flag, value in (
            ("--batch-axis", args.batch_axis),
            ("--model-axis", args.model_axis),
            ("--context-axis", args.context_axis),
        )
        if value is not None
    ]
    if named:
        raise PlanError(
            "--search names the axes of the meshes it builds itself (batch, "
            "model, context): drop "
            + ", ".join(n.split()[0] for n in named)
            + f". Received: {', '.join(named)}"
        )


def answer(args) -> dict:
    """The search's table and its `--json` object."""
    from keras_hub_autodist.searching.report import table
    from keras_hub_autodist.searching.report import to_json
    from keras_hub_autodist.searching.search import REMATS
    from keras_hub_autodist.searching.search import STRATEGIES
    from keras_hub_autodist.searching.search import search

    result = search(
        args.preset,
        args.device,
        args.devices,
        args.batch,
        args.seq,
        args.lora_rank,
        per_device_batch=args.per_device_batch,
        dtype=args.dtype,
        optimizer=args.optimizer,
        strategies=STRATEGIES if args.strategy == "auto" else (args.strategy,),
        remats=REMATS if args.remat is None else (args.remat,),
        context_parallel_strategy=args.context_parallel_strategy,
    )
    return {"text": table(result), "json": to_json(result)}


__all__ = ["answer", "check_flags", "parse_batch", "parse_batch_range"]
