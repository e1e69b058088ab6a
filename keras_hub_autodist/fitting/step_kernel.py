"""The attention kernel the closed-form estimate counts on a plan's
devices: the layers' own rule (`attention.attention_blocks`), read from
the plan's shapes instead of a traced step's."""

from __future__ import annotations

import math

from keras_hub_autodist.attention.attention_blocks import BLOCK_KERNELS
from keras_hub_autodist.attention.attention_blocks import PER_DEVICE_ARCHITECTURES
from keras_hub_autodist.attention.attention_blocks import context_kernel
from keras_hub_autodist.attention.attention_blocks import every_mesh_kernel
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.device_profiles import device_key


def per_device_attention(plan) -> bool:
    """Whether `plan`'s attention runs per device, one block of keys at a
    time, on a context mesh (`attention.context_attention`)."""
    return plan.architecture in PER_DEVICE_ARCHITECTURES


def gives_head_shape(row) -> bool:
    """Whether `row` has the attention's `heads` and `head_dim` axes: the
    query's kernel, or where that is flat (`(embed, heads · head_dim)`,
    SmolLM3's) the output projection's. One per decoder block."""
    return {"heads", "head_dim"} <= set(row.logical_axes)


# The logical axes a weight's model-axis shards split its activations on.
MODEL_PARALLEL = frozenset({"vocab", "heads", "kv_heads", "head_dim", "mlp", "expert"})


def row_dim(row, logical: str) -> int:
    """The size of `row`'s dimension of logical axis `logical`."""
    return row.shape[row.logical_axes.index(logical)]


def device_shards(plan, row, logicals=MODEL_PARALLEL) -> int:
    """How many ways the mesh axes of `row` (a row of `plan`) split its
    dimensions of `logicals`, and so the activations it makes: but the
    batch and context axes, over which weights are gathered where they
    are used (`fsdp`), which split no activation of the weight."""
    axes = plan.mesh_axes
    return math.prod(
        axes.size(axis)
        for axis, logical in zip(row.spec, row.logical_axes)
        if axis
        and axis not in (axes.batch_axis, axes.context_axis)
        and logical in logicals
    )


def num_blocks(plan) -> int:
    """The decoder blocks of a plan: the rows of its query's pattern."""
    query = next((r for r in plan.rows if gives_head_shape(r)), None)
    return sum(1 for r in plan.rows if r.pattern == query.pattern) if query else 1


def _device_heads(plan, query) -> int:
    """The query heads of `query` (a row of `plan`) on one device: split by
    the mesh axes its `heads` dimension is laid on, but the batch and
    context axes (gathered where the weight is used)."""
    return row_dim(query, "heads") // device_shards(plan, query, {"heads"})


def per_device_kernel(
    plan, sequence_length: int, platform: str = "gpu", rows: int = 1
) -> str | None:
    """The kernel each device of `plan` holding `rows` sequences attends
    one block of keys at a time with on the devices of `platform` (a
    platform or a named device), by the layers' own rule
    (`attention_blocks.context_kernel` on a context mesh,
    `every_mesh_kernel` off one), or None where the layers keep XLA's
    attention or the estimate can't tell (`BLOCK_KERNELS`: cuDNN's).

    Example:
    ```python
    per_device_kernel(plan, 32768, "v5e")  # "splash"
    per_device_kernel(plan, 32768, "h100")  # None: XLA's counted
    ```
    """
    query = next((r for r in plan.rows if gives_head_shape(r)), None)
    if not per_device_attention(plan) or query is None:
        return None
    axes = plan.mesh_axes
    contexts = axes.size(axes.context_axis)
    # A named device ("v3-8") tells its kind; a bare platform doesn't.
    device_kind = device_key(platform)
    platform = platform_of(platform)
    if contexts > 1:
        return context_kernel(
            platform,
            sequence_length,
            contexts,
            plan.context_parallel_strategy,
            device_kind=device_kind,
        )
    heads = _device_heads(plan, query)
    kernel = every_mesh_kernel(platform, sequence_length, rows, heads, device_kind)
    return kernel if kernel in BLOCK_KERNELS else None


def platform_of(platform: str) -> str:
    """The platform of a platform or a named device (`DEVICE_PROFILES`).

    Example:
    >>> platform_of("V5E"), platform_of("cpu")
    ('tpu', 'cpu')
    """
    key = device_key(platform)
    return DEVICE_PROFILES[key].platform if key in DEVICE_PROFILES else key
