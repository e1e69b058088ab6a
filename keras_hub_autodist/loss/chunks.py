"""How a causal LM's loss is cut into chunks of tokens, as data: the memory
estimate reads it without importing JAX (`chunked_cross_entropy` computes
with it)."""

from __future__ import annotations

# A step whose float32 logits take at most this on each device keeps Keras'
# own step, whole logits and all, unless its head is small (below): cutting
# a large head's loss costs time (each chunk reads the head's weights again;
# 1.8% of a Gemma 2B LoRA step of 4 x 1024 tokens on a v5e chip), and below
# this the whole logits fit beside the step (Gemma 3 1B at 4,096 tokens on
# one 16 GiB chip: 4 GiB).
WHOLE_LOGITS_BYTES = 4 * 2**30
# The float32 logits one chunk may hold on each device.
CHUNK_LOGITS_BYTES = 256 * 2**20
# Where memory asks for fewer, a step's tokens are still cut into this many
# chunks: a chunk's logits, their float32 copy and their gradient then hold
# a tenth of the whole logits...
FEWEST_CHUNKS = 32
# ... as long as the head's weights, which each chunk reads again (and a
# trained head's float32 gradient, which each chunk adds to), take at most
# this much more traffic in all: a few MiB a chunk for a small model's head,
# while a large model's head (hundreds of MiB) is read once per chunk that
# memory needs and no more, as each extra read would cost it time.
SPARE_HEAD_TRAFFIC_BYTES = 256 * 2**20


def chunk_count(
    rows: int,
    sequence: int,
    vocabulary: int,
    splits: int = 1,
    head_bytes: int = 0,
    trained_head_bytes: int = 0,
) -> int:
    """The number of chunks a step's sequences are cut into, on a device
    holding `rows` of them and `vocabulary` logits per token: where they
    take more than `WHOLE_LOGITS_BYTES`, the fewest, dividing `sequence //
    splits`, whose float32 logits fit `CHUNK_LOGITS_BYTES` (or twice
    `trained_head_bytes` where that is more: a trained head's gradient
    costs that anyway); and, off a context axis, at least `FEWEST_CHUNKS`
    where the head's weights are small enough to read that often
    (`SPARE_HEAD_TRAFFIC_BYTES`). 1 is the whole logits, Keras' own step.
    Every token is a chunk of its own where no larger chunk divides the
    sequence.

    Args:
        rows: sequences per device.
        sequence: tokens per sequence.
        vocabulary: logits per token on one device (the model axis' share
            where it splits the vocabulary).
        splits: the parts the sequence is split in over a context axis; a
            device holds one, and a chunk count that divides each part
            keeps the split.
        head_bytes: the bytes of the head's weights on one device.
        trained_head_bytes: those of them that are trained (0 when the
            head is frozen, as under LoRA).

    Example:
    >>> chunk_count(1, 32768, 262144, head_bytes=2**30)
    128
    >>> chunk_count(1, 4096, 262144, head_bytes=2**30)
    1
    >>> chunk_count(2, 256, 8192, head_bytes=2**20, trained_head_bytes=2**20)
    32
    """
    part = sequence // splits if sequence % splits == 0 else sequence
    whole = rows * part * vocabulary * 4
    budget = max(CHUNK_LOGITS_BYTES, 2 * trained_head_bytes)
    needed = 1 if whole <= WHOLE_LOGITS_BYTES else -(-whole // budget)
    traffic = head_bytes + 2 * trained_head_bytes  # read, and gradient added
    affordable = SPARE_HEAD_TRAFFIC_BYTES // max(traffic, 1)
    # A context axis already splits each device's logits by its size.
    small = min(FEWEST_CHUNKS, affordable) if splits == 1 else 1
    fewest = max(needed, small, 1)
    for chunks in range(fewest, part + 1):
        if part % chunks == 0:
            return chunks
    return part
