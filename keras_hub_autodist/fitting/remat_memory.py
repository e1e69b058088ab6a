"""What the closed form counts under each block policy of `remat=`
(`remat_arguments.BLOCK_POLICIES`): the activations of
`step_memory.activation_bytes` when each decoder block is recomputed in the
backward pass.

- `"full"`: every block keeps its input (one residual-stream buffer, or
  `CONTEXT_REMAT_STREAMS` on a context mesh); the backward pass holds the
  larger of the head's buffers and one block's recomputed activations.
- `"dots"`: every block keeps its input and its weight matmuls' outputs
  (`saved_dot_elements`, `SAVED_DOTS` buffers of each); the backward pass
  holds one block's recomputed rest, its activations less the outputs it
  kept.

Gathered weights and float32 copies count as without remat.
"""

from __future__ import annotations

from keras_hub_autodist.fitting.memory_factors import CONTEXT_REMAT_STREAMS
from keras_hub_autodist.fitting.memory_factors import SAVED_DOTS
from keras_hub_autodist.fitting.step_kernel import device_shards
from keras_hub_autodist.fitting.step_kernel import gives_head_shape
from keras_hub_autodist.fitting.step_kernel import num_blocks
from keras_hub_autodist.fitting.step_kernel import row_dim
from keras_hub_autodist.fitting.trained_state import is_lora_target
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.remat_arguments import block_policy
from keras_hub_autodist.planning.step_shape import runnable_step
from keras_hub_autodist.reading.dtypes import itemsize

# The terms of each decoder block, kept per block without rematerialization
# (`scores_one_block` is one block's already), and those of the head.
BLOCK_TERMS = (
    "stream",
    "attention",
    "scores",
    "kernel_residuals",
    "masks",
    "mlp",
    "experts",
)
HEAD_TERMS = ("final", "logits", "logits_whole", "logits_float32", "logits_soft_cap")
# More norms of the hidden size than this in a block: norms after its
# output and down projections too (Gemma 2's and 3's `post_ffw_norm`), whose
# backward pass reads the down projection's output.
PRE_NORMS = 2


def saved_dot_elements(plan, batch_size: int, sequence_length: int) -> float:
    """Elements per device of the weight matmuls' outputs every block keeps
    under `remat="dots"`, all blocks together: what
    `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` saves of a
    keras-hub decoder block and its backward pass reads.

    Per block, on the tokens the device holds: the query, key and value
    projections, the attention's output projection and each MLP
    up-projection (every expert's, for a mixture of experts: their
    up-projections have no batch dimension); the down projection where a
    norm follows it (more than `PRE_NORMS` norms of the hidden size a
    block), since elsewhere only the residual sum reads it. Under LoRA each
    adapted kernel's merged copy (`kernel + a @ b`, a matmul of weights),
    a kernel's share per device. Split by the model axes as
    `step_memory.activation_terms` splits the same activations.

    Example:
    ```python
    saved_dot_elements(plan, 8, 2048)
    ```
    """
    axes = plan.mesh_axes
    rows = runnable_step(axes, batch_size, sequence_length).rows
    tokens = rows // axes.size(axes.batch_axis)
    tokens *= sequence_length / axes.size(axes.context_axis)
    query = next((r for r in plan.rows if gives_head_shape(r)), None)
    if query is None:
        return 0.0
    block = query.path.split("/", 1)[0] + "/"
    keys = [r for r in plan.rows if "kv_heads" in r.logical_axes]
    ups = [r for r in plan.rows if r.logical_axes[-2:] == ("embed", "mlp")]
    hidden = row_dim(ups[0], "embed") if ups else 0
    split = 1
    if plan.sequence_parallel and sharding.sequence_parallel_spec(axes):
        split = axes.size(axes.model_axis)
    # The query, key and value projections.
    width = row_dim(query, "heads") * row_dim(query, "head_dim")
    per_block = width / device_shards(plan, query)
    if keys:
        kv_width = row_dim(keys[0], "kv_heads")
        if "head_dim" in keys[0].logical_axes:
            kv_width *= row_dim(keys[0], "head_dim")
        per_block += 2 * kv_width / device_shards(plan, keys[0])
    else:
        per_block += 2 * width / device_shards(plan, query)
    # The output projection, and the down projection where a norm reads it.
    norms = [
        r
        for r in plan.rows
        if r.path.startswith(block)
        and r.logical_axes == ("norm",)
        and r.shape == (hidden,)
    ]
    per_block += (2 if len(norms) > PRE_NORMS else 1) * hidden / split
    # Every block's up-projections: a row each.
    mlp = sum(
        row_dim(r, "mlp")
        * (row_dim(r, "expert") if "expert" in r.logical_axes else 1)
        / device_shards(plan, r)
        for r in ups
    )
    merged = 0
    if getattr(plan, "lora_rank", None) is not None:
        adapted = [r for r in plan.rows if is_lora_target(r.path)]
        merged = sum(r.device_bytes // itemsize(r.dtype) for r in adapted)
    return tokens * (num_blocks(plan) * per_block + mlp) + merged


def rematerialized_bytes(
    plan,
    terms: dict[str, float],
    sizes: dict[str, int],
    weighted: dict[str, float],
    calibration: str,
    on_context_mesh: bool,
    batch_size: int,
    sequence_length: int,
) -> float:
    """The activation bytes of the step of a plan whose `remat` is a block
    policy: every block's input (one residual-stream buffer, or as many as
    the compiler keeps on a context mesh: `CONTEXT_REMAT_STREAMS`) and what
    else the policy keeps on the device (under `"dots"` the matmuls'
    outputs, `SAVED_DOTS` buffers of each, in the stream's bytes per
    element); beside them the larger of the head's buffers (before the
    backward pass reaches the blocks) and one block's recomputed
    activations and score gradients, less what it kept, with the final
    states' gradient (after the head's are freed); gathered weights and
    copies as without.

    Args:
        plan: a `LayoutPlan` whose `remat` is a block policy.
        terms: elements per device of each term
            (`step_memory.activation_terms`).
        sizes: bytes per element of each (`step_memory.term_sizes`).
        weighted: bytes of each, with its factor.
        calibration: the factors' key (`step_memory.calibration_of`).
        on_context_mesh: whether the plan's mesh splits the sequence.
        batch_size: the global batch.
        sequence_length: tokens per sequence.
    """
    policy = block_policy(plan.remat)
    layers = num_blocks(plan)
    streams = CONTEXT_REMAT_STREAMS.get(calibration, 1) if on_context_mesh else 1
    inputs = streams * terms["stream"] * sizes["stream"]
    saved = 0.0
    if policy.saveable is not None:
        elements = saved_dot_elements(plan, batch_size, sequence_length)
        saved = SAVED_DOTS[calibration] * elements * sizes["stream"]
    # The blocks are differentiated with the head's gradient of the final
    # states beside them.
    one_block = (
        sum(weighted[name] for name in BLOCK_TERMS) / layers
        + weighted["scores_one_block"]
        + weighted["final"]
        - saved / layers
    )
    head = sum(weighted[name] for name in HEAD_TERMS)
    kept = weighted.keys() - set(BLOCK_TERMS) - set(HEAD_TERMS) - {"scores_one_block"}
    return inputs + saved + max(one_block, head) + sum(weighted[n] for n in kept)
