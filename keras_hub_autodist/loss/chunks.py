"""How a causal LM's loss is cut into chunks of tokens, as data: the memory
estimate reads it without importing JAX (`chunked_cross_entropy` computes
with it)."""

from __future__ import annotations

# The float32 logits one chunk may hold, for the whole batch (a device holds
# its share of them).
CHUNK_LOGITS_BYTES = 256 * 2**20


def chunk_count(
    batch: int,
    sequence: int,
    vocabulary: int,
    splits: int = 1,
    trained_head_bytes: int = 0,
) -> int:
    """The number of chunks a sequence is cut into: the fewest, dividing
    `sequence // splits`, whose float32 logits fit `CHUNK_LOGITS_BYTES`, or
    twice `trained_head_bytes` where that is more.

    Cutting costs a trained head one more gradient of its kernel (the
    chunks' sum is kept beside each chunk's), so a chunk may hold as many
    logits as that costs: a step whose logits are no larger stays whole.

    Args:
        batch: sequences per step.
        sequence: tokens per sequence.
        vocabulary: logits per token.
        splits: the parts the sequence is split in over a context axis; a
            chunk count that divides each part keeps the split.
        trained_head_bytes: the bytes of the head's trained weights (0
            when they are frozen, as under LoRA).

    Example:
    >>> chunk_count(1, 32768, 262144)
    128
    >>> chunk_count(8, 64, 1000)
    1
    """
    whole = batch * sequence * vocabulary * 4
    budget = max(CHUNK_LOGITS_BYTES, 2 * trained_head_bytes)
    part = sequence // splits if sequence % splits == 0 else sequence
    for chunks in range(1, part + 1):
        if part % chunks == 0 and whole <= chunks * budget:
            return chunks
    return part
