"""Causal load balancing over the context axis, as data: which queries
each device attends.

On a causal sequence cut in `2 · contexts` half blocks, device `i` attends
half blocks `i` and `2 · contexts - 1 - i` (head and tail), so that every
device has as many keys before its queries as any other.
"""

from __future__ import annotations

import numpy as np


def query_order(sequence: int, contexts: int, balanced: bool) -> np.ndarray:
    """The position of each query in the order the devices attend them:
    device `i`'s block is the `i`-th `sequence / contexts` of it.

    Example:
    >>> query_order(8, 2, balanced=True).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    if not balanced:
        return np.arange(sequence)
    half = sequence // (2 * contexts)
    return np.concatenate(
        [
            np.arange(chunk * half, (chunk + 1) * half)
            for pair in balanced_chunks(contexts)
            for chunk in pair
        ]
    )


def balanced_chunks(contexts: int) -> list[tuple[int, int]]:
    """The two half blocks of queries each device attends on a causal
    sequence cut in `2 · contexts` half blocks: device `i` takes half
    blocks `i` and `2 · contexts - 1 - i` (head and tail), so that each
    has as many keys before its queries as any other.

    Example:
    >>> balanced_chunks(4)
    [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    return [(i, 2 * contexts - 1 - i) for i in range(contexts)]


def owner(chunk: int, contexts: int) -> int:
    """The device that attends half block `chunk` (`balanced_chunks`)."""
    return chunk if chunk < contexts else 2 * contexts - 1 - chunk


def score_blocks_per_device(
    sequence: int, contexts: int, key_block: int, balanced: bool = True
) -> list[int]:
    """How many `[half block of queries, key block]` score blocks each
    device computes on a causal sequence (key blocks after every query are
    skipped), with the queries balanced (`balanced_chunks`) or contiguous.

    Example:
    >>> score_blocks_per_device(4096, 4, 256, balanced=False)
    [6, 14, 22, 30]
    >>> score_blocks_per_device(4096, 4, 256)
    [18, 18, 18, 18]
    """
    half = sequence // (2 * contexts)
    chunks = (
        balanced_chunks(contexts)
        if balanced
        else [(2 * i, 2 * i + 1) for i in range(contexts)]
    )

    def blocks(chunk):
        last_query = (chunk + 1) * half - 1
        return sum(1 for start in range(0, sequence, key_block) if start <= last_query)

    return [sum(blocks(chunk) for chunk in pair) for pair in chunks]
