"""How a causal LM's loss is cut into chunks of tokens, as data: the memory
estimate reads it without importing JAX (`chunked_cross_entropy` computes
with it)."""

from __future__ import annotations

# A step whose float32 logits take at most this on each device keeps Keras'
# own step, whole logits and all: what that step holds is what the memory
# answer was calibrated on, and it is keras-hub's step to the byte (Gemma 3
# 1B at 4,096 tokens on one chip: 4 GiB). Beyond it (8,192 tokens of that
# vocabulary and more) the loss is taken a chunk of tokens at a time.
WHOLE_LOGITS_BYTES = 4 * 2**30
# The float32 logits one chunk may hold on each device.
CHUNK_LOGITS_BYTES = 256 * 2**20


def chunk_count(
    rows: int,
    sequence: int,
    vocabulary: int,
    splits: int = 1,
    trained_head_bytes: int = 0,
) -> int:
    """The number of chunks a step's sequences are cut into, on a device
    holding `rows` of them and `vocabulary` logits per token: 1 (the whole
    logits, Keras' own step) where they take at most `WHOLE_LOGITS_BYTES`,
    else the fewest chunks, dividing `sequence // splits`, whose float32
    logits fit `CHUNK_LOGITS_BYTES`, or twice `trained_head_bytes` where
    that is more.

    Cutting costs a trained head one more gradient of its kernel (the
    chunks' sum is kept beside each chunk's), so a chunk may hold as many
    logits as that costs.

    Args:
        rows: sequences per device.
        sequence: tokens per sequence.
        vocabulary: logits per token on one device (the model axis' share
            where it splits the vocabulary).
        splits: the parts the sequence is split in over a context axis; a
            device holds one, and a chunk count that divides each part
            keeps the split.
        trained_head_bytes: the bytes of the head's trained weights on one
            device (0 when they are frozen, as under LoRA).

    Example:
    >>> chunk_count(1, 32768, 262144)
    128
    >>> chunk_count(1, 4096, 262144), chunk_count(1, 8192, 262144)
    (1, 32)
    """
    part = sequence // splits if sequence % splits == 0 else sequence
    whole = rows * part * vocabulary * 4
    if whole <= WHOLE_LOGITS_BYTES:
        return 1
    budget = max(CHUNK_LOGITS_BYTES, 2 * trained_head_bytes)
    for chunks in range(2, part + 1):
        if part % chunks == 0 and whole <= chunks * budget:
            return chunks
    return part
