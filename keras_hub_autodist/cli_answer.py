"""The answer of `keras-hub-autodist plan`: the plan, one fit verdict and
its advice, as text and as the `--json` object.

One question, one verdict: without `--compiled` the closed form's (yes, NO,
or on a TPU maybe: `fitting.verdicts`), with it the compiled step's; the
text prints that verdict once, and the advice is that verdict's.
"""

from __future__ import annotations

import importlib.util

from keras_hub_autodist import cli_search
from keras_hub_autodist.cli_flags import as_flags
from keras_hub_autodist.fitting.device_memory import GIB

# How `--json` names each verdict (`fits` is true, false, or null for maybe).
VERDICT_NAMES = {"yes": "yes", "maybe": "maybe", "NO": "no"}


def compiles_by_default(args) -> bool:
    """Whether the command compiles a step it was not asked to compile: a
    TPU `--device` whose compiler (libtpu) is installed here, with
    `--batch` and `--seq`, and not `--closed-form`. The TPU compiler
    rematerializes when memory is short, which the closed form can only
    bound (`fits: maybe`); its compile answers, as MaxText's
    `train_compile` does.

    Example:
    ```python
    compiles_by_default(build_parser().parse_args(["plan", "./p", ...]))
    ```
    """
    from keras_hub_autodist.fitting.device_profiles import device_profile

    return bool(
        args.device
        and args.batch is not None
        and args.seq is not None
        and not (args.compiled or args.closed_form or args.search)
        and device_profile(args.device).platform == "tpu"
        and importlib.util.find_spec("libtpu") is not None
    )


def compiles(args) -> bool:
    """Whether the command compiles the step: `--compiled`, or by default
    (`compiles_by_default`)."""
    return bool(args.compiled) or compiles_by_default(args)


def answer(args) -> dict:
    """The plan, its memory verdict and the compiled check, as text and as
    the `--json` object (with `--search`, the layout search's).

    Example:
    ```python
    answer(build_parser().parse_args(["plan", "./p", "--mesh", "batch=2"]))
    ```
    """
    if args.search:
        return cli_search.answer(args)
    from keras_hub_autodist.fitting import compiled_answer as compiled
    from keras_hub_autodist.fitting import report
    from keras_hub_autodist.fitting.device_profiles import device_profile
    from keras_hub_autodist.fitting.device_profiles import usable_memory
    from keras_hub_autodist.fitting.planner import plan
    from keras_hub_autodist.fitting.verdicts import step_verdict

    result = plan(
        args.preset,
        args.mesh,
        strategy=args.strategy,
        batch_axis=args.batch_axis,
        model_axis=args.model_axis,
        context_axis=args.context_axis,
        context_parallel_strategy=args.context_parallel_strategy,
        dtype=args.dtype,
        device_memory=args.device or args.device_memory,
        lora_rank=args.lora_rank,
        remat=args.remat,
        num_devices=args.devices,
        # `--mesh auto` chooses a batch axis that divides `--batch`.
        batch_size=args.batch if args.mesh == "auto" else None,
    )
    memory = None
    by_default = compiles_by_default(args)
    if args.compiled or by_default:
        from keras_hub_autodist.fitting.compiled_step import compiled_memory

        memory = compiled_memory(
            result, args.batch, args.seq, args.optimizer, device=args.device
        )
    # The compiler whose buffers the estimate counts: the named device's
    # (its platform's factors and its own arithmetic), else the one that
    # compiled the check, else an accelerator's.
    if args.device:
        platform = device_profile(args.device).platform
        calibration = args.device
    elif memory is not None and memory.platform in ("cpu", "gpu", "tpu"):
        platform = calibration = memory.platform
    else:
        platform = calibration = "gpu"
    verdict = step_verdict(result, args.batch, args.seq, args.optimizer, calibration)
    estimate = verdict.estimate
    _, _, closed_line = report.memory_verdict(
        result, args.batch, args.seq, args.optimizer, calibration
    )
    assumption = usable_memory(device_profile(args.device))[1] if args.device else None
    capacity = result.device_memory_bytes
    if memory is not None:
        fits = compiled.compiled_fits(memory, capacity)
        name = "yes" if fits else "no"
        advice = compiled.compiled_advice(
            result,
            memory,
            estimate,
            args.batch,
            args.seq,
            args.optimizer,
            calibration,
            device=args.device,
        )
        line = compiled.compiled_verdict(result, memory, assumption)
        if advice:
            line += "; to fit: " + "; or ".join(advice)
        if by_default:
            line += (
                f" (compiled by default: the {args.device} compiler is installed "
                "here; `--closed-form` answers without compiling)"
            )
    else:
        fits, name = verdict.fits, VERDICT_NAMES[verdict.answer]
        advice = report.fit_advice(
            result, args.batch, args.seq, args.optimizer, calibration
        )
        line = closed_line
    # The advice names options as this command's flags.
    if args.batch is None:
        text = [str(result)]
    else:
        text = [
            result.table() + "\n\n" + "\n".join(report.summary_lines(result)),
            _step_lines(result, args, estimate, calibration, memory),
            line,
        ]
    json_answer = {
        "fits": fits,
        "verdict": name,
        "estimate_fits": verdict.fits,
        "estimate_verdict": VERDICT_NAMES[verdict.answer],
        "estimate_bytes_per_device": estimate.total_bytes,
        "estimate_least_bytes_per_device": verdict.least_bytes,
        "device_memory_bytes": capacity,
        "estimate_covers": (
            "training step" if args.batch is not None else "weights and optimizer state"
        ),
        "estimate_parts": {
            "weights": estimate.weights,
            "optimizer_state": estimate.optimizer_state,
            "gradients": estimate.gradients,
            "gradients_at_peak": estimate.live_gradients,
            "activations": estimate.activations,
            "update_temporaries": estimate.update_temporaries,
        },
        "preset": result.preset,
        "mesh": dict(zip(result.mesh_axes.axis_names, result.mesh_axes.shape)),
        "strategy": result.strategy,
        "dtype": result.mixed_policy or result.dtype,
        "variable_dtype": result.dtype,
        "optimizer": args.optimizer,
        "batch_size": args.batch,
        "padded_batch_size": _padded_batch(result, args),
        "sequence_length": args.seq,
        "lora_rank": result.lora_rank,
        "remat": result.remat,
        "device": result.device_name or None,
        "device_memory_source": result.device_memory_source,
        "device_memory_assumption": assumption,
        "platform": platform,
        "advice": [as_flags(item) for item in advice],
        "compiled_by_default": by_default,
    }
    if memory is not None:
        json_answer.update(compiled.compiled_fields(memory, capacity))
    return {"text": as_flags("\n".join(text)), "json": json_answer}


def _padded_batch(result, args) -> int | None:
    """The batch a bound model runs for `--batch`: padded up to a multiple
    of the batch axis (None without a step)."""
    from keras_hub_autodist.planning.step_shape import runnable_step

    if args.batch is None:
        return None
    return runnable_step(result.mesh_axes, args.batch, args.seq).rows


def _step_lines(result, args, estimate, calibration, memory) -> str:
    """The closed-form estimate of the step, and the compiled check."""
    gib = GIB
    padded = _padded_batch(result, args)
    batch = f"{args.batch}" + (f" (padded to {padded})" if padded != args.batch else "")
    dtype = f", {result.mixed_policy}" if result.mixed_policy else ""
    lines = [
        f"training step, batch {batch} x {args.seq} tokens{dtype}, "
        f"{args.optimizer}, estimated per device ({calibration}): "
        f"{estimate.total_bytes / gib:.2f} GiB (weights "
        f"{estimate.weights / gib:.2f}, optimizer state "
        f"{estimate.optimizer_state / gib:.2f}, then the larger of the "
        f"backward pass's activations {estimate.activations / gib:.2f} and "
        f"gradients {estimate.live_gradients / gib:.2f} and the update's "
        f"gradients {estimate.gradients / gib:.2f} and temporaries "
        f"{estimate.update_temporaries / gib:.2f}) of "
        f"{result.device_memory_bytes / gib:.1f} GiB"
    ]
    if memory is not None:
        lines.append(str(memory))
        lines.append(
            f"estimate / compiled peak: {estimate.total_bytes / memory.peak_bytes:.2f}"
        )
    return "\n".join(lines)


__all__ = ["answer"]
