"""Flops and HBM bytes of a compiled program, counted from its HLO text.

XLA's GPU compile-only client gives no `cost_analysis()`; the roofline of
a step (`searching.step_cost`) still needs its flops and the bytes it moves through
memory. Both are read here from the optimized HLO text:

- flops: `2 x` the output elements `x` the contracted elements of every
  matrix product, whether XLA left it a `dot` (inside a fusion or not) or
  called cuBLAS for it (`__cublas$gemm`, `__cublas$lt$matmul`, whose
  `dot_dimension_numbers` sit in the backend config). Elementwise work is
  left out: next to the matrix products of a transformer step it is noise.
- bytes: every instruction of the program's unfused computations (the
  entry and the loops it runs) reads its operands from memory and writes
  its result there: a fusion keeps its intermediates on chip, which is
  what fusions are for. Shapes are looked up by name, as the compiled text
  does not repeat an operand's shape.

- link bytes: what each device sends over its links for the program's
  collectives, by the ring algorithms' traffic (`LINK_TRAFFIC`) over the
  group each runs in (read from its `replica_groups`).

Reads text only; imports nothing beyond the standard library.
"""

from __future__ import annotations

import re

from keras_hub_autodist.fitting.compiled_analysis import COLLECTIVE_KINDS
from keras_hub_autodist.fitting.compiled_analysis import array_bytes
from keras_hub_autodist.fitting.compiled_analysis import cost_figures

# `%name = shape op(operands), attributes`: one instruction.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*"
    r"(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<operands>[^)]*)\)(?P<rest>.*)$"
)
# `%computation (param: shape, ...) -> shape {` or `ENTRY %main ... {`.
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_PARAMETER = re.compile(
    r"(?P<name>[\w.\-]+):\s*(?P<shape>[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)"
)
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)")
_DIMS = re.compile(r"\[(?P<dims>[0-9,]*)\]")
_CALLED = re.compile(r"(?P<how>calls|to_apply)=%(?P<name>[\w.\-]+)")
_DOT_LHS = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_GEMM_LHS = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
# Instructions that move no bytes of their own.
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "after-all",
        "partition-id",
        "replica-id",
    }
)


def _dims(shape: str) -> list[int]:
    match = _DIMS.search(shape)
    if not match or not match["dims"]:
        return []
    return [int(d) for d in match["dims"].split(",")]


def _elements(shape: str) -> int:
    count = 1
    for dim in _dims(shape):
        count *= dim
    return count


def _contracted(shape: str, dims_text: str) -> int:
    """Elements of `shape` over the contracted dimensions `dims_text`."""
    dims = _dims(shape)
    count = 1
    for index in re.findall(r"\d+", dims_text):
        if int(index) < len(dims):
            count *= dims[int(index)]
    return count


def _parse(hlo_text: str):
    """Per instruction: (computation, name, shape, op, operands, rest); the
    shapes of every name; and the computations fusions (or reductions)
    call, whose instructions never touch memory on their own."""
    shapes: dict[str, str] = {}
    instructions = []
    inner: set[str] = set()
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("(")[0]:
            computation = header["name"]
            for parameter in _PARAMETER.finditer(line.split("->")[0]):
                shapes[parameter["name"]] = parameter["shape"]
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shapes[match["name"]] = match["shape"]
        operands = [m["name"] for m in _OPERAND.finditer(match["operands"])]
        instructions.append(
            (computation, match["name"], match["shape"], match["op"], operands)
            + (match["rest"],)
        )
        for called in _CALLED.finditer(match["rest"]):
            if called["how"] == "to_apply" or match["op"] == "fusion":
                inner.add(called["name"])
    return instructions, shapes, inner


def _first_array(shape: str) -> str:
    """The first array of a shape (a custom call's result, before its
    workspace)."""
    found = re.search(r"[a-z0-9]+\[[0-9,]*\]", shape)
    return found.group(0) if found else shape


def hlo_cost(hlo_text: str) -> dict:
    """`{"flops", "bytes_accessed"}` per device counted from a compiled
    program's HLO text; `{}` for a text with no instruction.

    Example:
    >>> text = '''ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
    ...   ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}
    ... }'''
    >>> hlo_cost(text)
    {'flops': 128.0, 'bytes_accessed': 224.0}
    """
    instructions, shapes, inner = _parse(hlo_text)
    if not instructions:
        return {}
    flops = 0
    moved = 0
    for computation, _, shape, op, operands, rest in instructions:
        lhs = shapes.get(operands[0], "") if operands else ""
        if op == "dot":
            found = _DOT_LHS.search(rest)
            flops += (
                2 * _elements(shape) * _contracted(lhs, found["dims"] if found else "")
            )
        elif op == "custom-call" and any(t in rest for t in _GEMM_TARGETS):
            found = _GEMM_LHS.search(rest)
            flops += (
                2
                * _elements(_first_array(shape))
                * _contracted(lhs, found["dims"] if found else "")
            )
        if computation in inner or op in _FREE or op.endswith("-done"):
            continue
        moved += array_bytes(shape) + sum(
            array_bytes(shapes.get(name, "")) for name in operands
        )
    return {"flops": float(flops), "bytes_accessed": float(moved)}


# Bytes one device sends for a collective over a group of `n` devices, per
# byte of its result (ring algorithms): an all-reduce sends its buffer out
# and back (2 (n-1)/n), an all-gather the others' shares ((n-1)/n of its
# result), a reduce-scatter all but its own share ((n-1) x its result), an
# all-to-all all but its own block, a permute its buffer once.
LINK_TRAFFIC = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[0-9,]*)\}")


def group_size(rest: str, default: int) -> int:
    """The devices a collective runs over, read from its `replica_groups`
    (`default` when it names none).

    Example:
    >>> group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8)
    4
    >>> group_size("replica_groups={{0,1},{2,3}}", 4)
    2
    """
    found = _MESH_GROUPS.search(rest)
    if found:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", found["axes"]))
        size = 1
        for axis in re.findall(r"'([^']+)'", found["over"]):
            size *= int(sizes.get(axis, 1))
        return size
    found = _IOTA_GROUPS.search(rest)
    if found:
        return int(found["size"])
    found = _LIST_GROUPS.search(rest)
    if found:
        return len([d for d in found["first"].split(",") if d])
    return default


def link_bytes(hlo_text: str, devices: int) -> float:
    """Bytes one device sends over its links for a program's collectives
    (`LINK_TRAFFIC` of each one's result over its group); an asynchronous
    pair counts once, by its `-done`, over its `-start`'s group.

    Example:
    >>> text = "%r = f32[1024]{0} all-reduce(%a), replica_groups={{0,1}}"
    >>> link_bytes(text, 2)
    4096.0
    """
    instructions, _, _ = _parse(hlo_text)
    starts = {}
    total = 0.0
    for _, name, shape, op, operands, rest in instructions:
        if op.endswith("-start"):
            starts[name] = rest
            continue
        kind = op.removesuffix("-done")
        if kind not in COLLECTIVE_KINDS:
            continue
        if op.endswith("-done"):
            rest = starts.get(operands[0], "") if operands else ""
        size = max(group_size(rest, devices), 1)
        total += array_bytes(shape) * LINK_TRAFFIC[kind](size)
    return total


def program_cost(cost, hlo_text: str, devices: int | None = None) -> dict:
    """A compiled program's per-device cost: XLA's cost analysis where the
    backend gives one (`compiled_analysis.cost_figures`), else counted from
    its HLO text (`hlo_cost`, and then `"counted_from_hlo": 1.0`); with the
    bytes each device sends over its links (`"link_bytes"`). A collective
    whose group the text does not say runs over `devices`, by default the
    program's partitions (its module's `num_partitions`).

    Example:
    >>> program_cost({"flops": 2.0}, "", 1)
    {'flops': 2.0, 'link_bytes': 0.0}
    """
    figures = cost_figures(cost)
    if not figures and hlo_text:
        figures = {**hlo_cost(hlo_text), "counted_from_hlo": 1.0}
    if devices is None:
        found = re.search(r"num_partitions=(\d+)", hlo_text)
        devices = int(found.group(1)) if found else 1
    figures["link_bytes"] = link_bytes(hlo_text, devices) if hlo_text else 0.0
    return figures


__all__ = ["LINK_TRAFFIC", "group_size", "hlo_cost", "link_bytes", "program_cost"]
