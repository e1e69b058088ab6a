"""Count collectives and their bytes in compiled HLO text."""

from __future__ import annotations

import math
import re

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f64": 8,
    "s64": 8,
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.*?)\s(?P<op>"
    + "|".join(COLLECTIVES)
    + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count": n, "bytes": result bytes}} over every instruction.

    Async pairs count once (the `-start`); bytes are those of the result
    shape (for a tuple-shaped `-start`, its last element, the output buffer).
    """
    found = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        arrays = _ARRAY.findall(match.group("shape"))
        if not arrays:
            continue
        if match.group("start") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]
        size = 0
        for dtype, dims in arrays:
            shape = [int(d) for d in dims.split(",") if d]
            size += math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
        found[match.group("op")]["count"] += 1
        found[match.group("op")]["bytes"] += size
    return found
