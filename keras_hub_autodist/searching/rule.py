"""The memory rule's choice (`device_mesh="auto"` in `plan()`) as a
candidate of the layout search: the layout every search compiles first,
so that what it chooses is never slower in the model than the rule.
"""

from __future__ import annotations

from keras_hub_autodist.fitting.planner import plan
from keras_hub_autodist.searching.candidates import STRATEGIES
from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.candidates import remat_key
from keras_hub_autodist.searching.inputs import SearchedStep


def rule_choice(
    preset,
    device,
    devices,
    batch_size,
    lora_rank,
    dtype,
    strategy: str = "auto",
    remat=None,
    context_parallel_strategy: str = "all_gather",
) -> tuple[dict[str, int], str]:
    """What `device_mesh="auto"` picks by the memory rule
    (`planner.resolve_mesh`) with the strategy (`"auto"`: the rule's too)
    and remat asked for, as a mesh and a strategy.

    Example:
    ```python
    rule_choice("./gemma_2b", "v5e", 8, 8, None, "bfloat16")
    # ({"batch": 8, "model": 1}, "fsdp")
    ```
    """
    chosen = plan(
        preset,
        "auto",
        strategy=strategy,
        num_devices=devices,
        batch_size=batch_size,
        device_memory=device,
        lora_rank=lora_rank,
        dtype=dtype,
        remat=remat,
        context_parallel_strategy=context_parallel_strategy,
    )
    axes = chosen.mesh_axes
    return dict(zip(axes.axis_names, axes.shape)), chosen.strategy


def rule_candidate(
    step: SearchedStep, devices: int, batch_size: int | None, strategies, remats
) -> Candidate:
    """The memory rule's choice as a candidate of the strategies and remats
    asked for, at the global batch `batch_size` in one step (0 where the
    batch is chosen later): the rule chooses the strategy only when both
    are asked for; its remat is off when off is asked for, else the first
    asked for."""
    strategy = "auto" if set(strategies) >= set(STRATEGIES) else strategies[0]
    keys = [remat_key(r) for r in remats]
    remat = None if None in keys else remats[0]
    mesh, chosen_strategy = rule_choice(
        step.preset,
        step.device,
        devices,
        batch_size,
        step.lora_rank,
        step.dtype,
        strategy=strategy,
        remat=remat,
        context_parallel_strategy=step.context_parallel_strategy,
    )
    return Candidate(mesh, chosen_strategy, remat, batch_size or 0)


__all__ = ["rule_candidate", "rule_choice"]
