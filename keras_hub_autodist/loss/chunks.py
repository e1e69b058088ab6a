"""How a causal LM's loss is cut into chunks of tokens, as data: the memory
estimate reads it without importing JAX (`chunked_cross_entropy` computes
with it)."""

from __future__ import annotations

# A step whose float32 logits take at most this on each device keeps Keras'
# own step, whole logits and all, unless its head is small (below). Cutting
# below it was measured and not taken: Gemma 2B's LoRA step of 4 x 1024
# tokens (3.9 GiB of logits) ran 1.005x as fast in 8 chunks on a v5e chip,
# in 1.65 GiB less, but compiled for an H200 it held only 1.8 GB less, where
# the closed form would count 4 GB less, and its full step's two chunks held
# 2 GB more (the trained head's float32 gradient they add to).
WHOLE_LOGITS_BYTES = 4 * 2**30
# The float32 logits one chunk may hold on each device...
CHUNK_LOGITS_BYTES = 256 * 2**20
# ... or, where that is more, those of this many tokens, while a device's
# whole logits take at most `LONG_LOGITS_BYTES`. Each chunk reads the
# head's bfloat16 weights again and makes, per byte of them, as many flops
# as it has tokens: at 512 that is above a v5e's ratio of compute to memory
# bandwidth (about 240 flops a byte; an H100's is about 300), so the head's
# matmul stays bound by compute. On a v5e chip, Gemma 2B's LoRA step of
# 8 x 1024 tokens ran at 0.990x whole logits' tokens/s in chunks of 256
# tokens, and at 1.018x in chunks of 512.
FEWEST_TOKENS = 512
# Past this much whole logits on a device the sequences are long, memory is
# what limits them, and a chunk keeps to `CHUNK_LOGITS_BYTES`: Gemma 3 1B's
# 32,768 tokens on a v5e compile to 14.67 GiB in chunks of 256 tokens and
# to 15.74 GiB, the chip's edge, in chunks of 512.
LONG_LOGITS_BYTES = 16 * 2**30
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
    splits`, whose float32 logits fit `CHUNK_LOGITS_BYTES` (or, where that
    is more, those of `FEWEST_TOKENS` tokens up to `LONG_LOGITS_BYTES` of
    whole logits, or twice `trained_head_bytes`: a trained head's gradient
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
    >>> chunk_count(1, 8192, 262144, head_bytes=2**30)
    16
    >>> chunk_count(1, 4096, 262144, head_bytes=2**30)
    1
    >>> chunk_count(2, 256, 8192, head_bytes=2**20, trained_head_bytes=2**20)
    32
    """
    part = sequence // splits if sequence % splits == 0 else sequence
    whole = rows * part * vocabulary * 4
    fewest_tokens = FEWEST_TOKENS if whole <= LONG_LOGITS_BYTES else 0
    budget = max(
        CHUNK_LOGITS_BYTES, fewest_tokens * vocabulary * 4, 2 * trained_head_bytes
    )
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
