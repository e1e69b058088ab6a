"""`device_mesh="auto"` on an accelerator: the layout search's winner.

On this machine's GPUs or TPUs of a kind the search knows
(`compile_targets.TARGETS`), `from_preset(..., device_mesh="auto")` asks
`search.search` for the fastest layout of a training step that fits and
loads on it; its reason becomes the mesh's (the line `from_preset`
prints). Elsewhere (CPU, an unknown device) and with
`$KERAS_HUB_AUTODIST_SEARCH` off, the memory rule chooses
(`planner.resolve_mesh`), as `plan()` always does.

`from_preset` knows no batch: the search is for one sequence per device of
`FROM_PRESET_SEQUENCE` tokens (at most the model's own limit) in one step
(no gradient accumulation: the optimizer is the user's), full fine-tuning
with Adam, the strategy, remat and context-parallel strategy as the call
asks: every candidate has them (remat is never switched on behind the
user's back: only `remat="auto"` searches the remats, those of
`candidates.REMATS`, and loads the winner's), and what is loaded is the
layout compiled, its axes named as the call names them (`batch_axis=`...).
"""

from __future__ import annotations

import dataclasses
import os

from keras_hub_autodist.environment import is_off
from keras_hub_autodist.fitting.compile_targets import TARGETS
from keras_hub_autodist.fitting.device_profiles import DEVICE_SPEEDS

SEARCH_ENV = "KERAS_HUB_AUTODIST_SEARCH"
# Tokens per sequence of the step searched for when none is given.
FROM_PRESET_SEQUENCE = 2048
ACCELERATORS = ("gpu", "tpu")


def local_device_name(devices) -> str | None:
    """The `--device` name of `devices` (JAX devices, or Keras' names of
    them, all of one kind), or `None` when they are not accelerators the
    search has figures for.

    Example:
    ```python
    local_device_name(jax.devices())  # "v5e" on a v5e VM, None on a CPU
    ```
    """
    if not devices:
        return None
    first = devices[0]
    if isinstance(first, str):
        # Keras lists devices by name ("gpu:0"): JAX's own say their kind.
        import jax

        first = jax.devices()[0]
    if getattr(first, "platform", "") not in ACCELERATORS:
        return None
    kind = getattr(first, "device_kind", "")
    for name, spec in TARGETS.items():
        if spec.platform == first.platform and all(w in kind for w in spec.kind_words):
            return name if name in DEVICE_SPEEDS else None
    return None


def searched_layout(preset, device_mesh, options, devices, search_remat=False):
    """`(device_mesh, options, reason)` for `from_preset`: with
    `device_mesh="auto"` on accelerators the search knows, the winner's
    mesh, its strategy (and with `search_remat`, its remat: `remat="auto"`,
    `options.split_auto_remat`) in `options`, and why; else what was
    given, and `""`."""
    if device_mesh != "auto" or is_off(os.environ.get(SEARCH_ENV, "")):
        return device_mesh, options, ""
    name = local_device_name(devices)
    if name is None:
        return device_mesh, options, ""
    from keras_hub_autodist.searching.report import chosen_reason
    from keras_hub_autodist.searching.search import REMATS
    from keras_hub_autodist.searching.search import STRATEGIES
    from keras_hub_autodist.searching.search import search

    result = search(
        preset,
        name,
        len(devices),
        batch_size=len(devices),
        sequence_length=FROM_PRESET_SEQUENCE,
        gradient_accumulation=False,
        dtype=options.dtype,
        strategies=STRATEGIES if options.strategy == "auto" else (options.strategy,),
        remats=REMATS if search_remat else (options.remat,),
        context_parallel_strategy=options.context_parallel_strategy,
    )
    chosen = result.chosen.candidate
    # What is loaded is the layout compiled: its mesh, strategy and remat
    # (the remat asked for, the only one searched, or with `remat="auto"`
    # the winner's).
    options = dataclasses.replace(options, strategy=chosen.strategy, remat=chosen.remat)
    return _named_axes(chosen.mesh, options), options, chosen_reason(result)


def _named_axes(mesh, options) -> dict[str, int]:
    """The searched mesh with its axes under the names the call gives them
    (`batch_axis=`, `model_axis=`, `context_axis=`): the same layout, the
    axes the options name.

    Example:
    >>> from keras_hub_autodist.planning.options import PlanOptions
    >>> _named_axes({"batch": 2, "model": 4}, PlanOptions(batch_axis="data"))
    {'data': 2, 'model': 4}
    """
    names = {
        "batch": options.batch_axis,
        "model": options.model_axis,
        "context": options.context_axis,
    }
    return {names.get(axis) or axis: size for axis, size in mesh.items()}


__all__ = ["FROM_PRESET_SEQUENCE", "SEARCH_ENV", "local_device_name", "searched_layout"]
