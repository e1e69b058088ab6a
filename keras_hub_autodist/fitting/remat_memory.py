"""What the closed form counts under `remat="full"`: the activations of
`step_memory.activation_bytes` when each decoder block is recomputed in the
backward pass. Every block keeps its input (one residual-stream buffer, or
`CONTEXT_REMAT_STREAMS` on a context mesh); the backward pass holds the
larger of the head's buffers and one block's recomputed activations.
Gathered weights and float32 copies count as without remat.
"""

from __future__ import annotations

from keras_hub_autodist.fitting.memory_factors import CONTEXT_REMAT_STREAMS
from keras_hub_autodist.fitting.step_kernel import num_blocks

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


def rematerialized_bytes(
    plan,
    terms: dict[str, float],
    sizes: dict[str, int],
    weighted: dict[str, float],
    calibration: str,
    on_context_mesh: bool,
) -> float:
    """The activation bytes of the step of a plan whose `remat` is
    `"full"`: every block's input (one residual-stream buffer, or as many
    as the compiler keeps on a context mesh: `CONTEXT_REMAT_STREAMS`);
    beside them the larger of the head's buffers (before the backward pass
    reaches the blocks) and one block's recomputed activations and score
    gradients, with the final states' gradient (after the head's are
    freed); gathered weights and copies as without.

    Args:
        plan: a `LayoutPlan` whose `remat` is `"full"`.
        terms: elements per device of each term
            (`step_memory.activation_terms`).
        sizes: bytes per element of each (`step_memory.term_sizes`).
        weighted: bytes of each, with its factor.
        calibration: the factors' key (`step_memory.calibration_of`).
        on_context_mesh: whether the plan's mesh splits the sequence.
    """
    layers = num_blocks(plan)
    streams = CONTEXT_REMAT_STREAMS.get(calibration, 1) if on_context_mesh else 1
    inputs = streams * terms["stream"] * sizes["stream"]
    # The blocks are differentiated with the head's gradient of the final
    # states beside them.
    one_block = (
        sum(weighted[name] for name in BLOCK_TERMS) / layers
        + weighted["scores_one_block"]
        + weighted["final"]
    )
    head = sum(weighted[name] for name in HEAD_TERMS)
    kept = weighted.keys() - set(BLOCK_TERMS) - set(HEAD_TERMS) - {"scores_one_block"}
    return inputs + max(one_block, head) + sum(weighted[n] for n in kept)
