"""The header of a `.safetensors` file, checked as strictly as safetensors'
own reader checks it.

A safetensors file is an 8-byte little-endian header length `N`, `N` bytes of
UTF-8 JSON, then the data buffer. `read_header` applies the rules of the
`safetensors` reader (`SafeTensors::read_metadata` and `Metadata::validate`
in its Rust crate), so that a file it refuses is refused here too instead of
loading aliased or shifted weights:

- the file holds the 8 length bytes; `N` is at most 100,000,000 and the
  header ends inside the file;
- the header is UTF-8 JSON (no `NaN`/`Infinity`, no name given twice) of one
  object: an optional `"__metadata__"` (null, or an object of strings) and
  one entry per tensor, each an object with a known `dtype` (`DTYPE_BITS`),
  a `shape` of non-negative integers and `data_offsets`, two non-negative
  integers `[begin, end]` with `begin <= end`;
- the tensors, sorted by offsets, tile the data buffer exactly: the first
  begins at 0, each begins where the one before ended (no gap, no overlap,
  no two tensors on the same bytes) and the last ends at the end of the
  file (no data past the last tensor);
- each tensor's element count times its element size is the length of its
  byte span, computed without overflow; sub-byte dtypes fill whole bytes.

Anything else is a `WeightFileError` naming the file and what is wrong.

Example:
```python
with HeldFile("model.safetensors") as file:
    header = read_header(file)
header.tensors["lm_head.weight"].shape
```
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys

from keras_hub_autodist.errors import WeightFileError

LENGTH_BYTES = 8
# safetensors refuses longer headers (`MAX_HEADER_SIZE`).
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
# safetensors' `usize`: larger integers are refused by its JSON reader.
MAX_INTEGER = 2**64 - 1
# Bits per element of every dtype of the safetensors format.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header, checked.

    Args:
        dtype: its safetensors dtype name (`"BF16"`).
        shape: its shape.
        begin: the offset of its first byte in the data buffer.
        end: the offset past its last byte.
    """

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header.

    Args:
        tensors: name -> `TensorEntry`.
        metadata: the `__metadata__` strings, or `None`.
        data_start: the file offset of the data buffer.
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] | None
    data_start: int


def read_header(file) -> SafetensorsHeader:
    """Read and check the header of the safetensors file `file`.

    Args:
        file: a `file_reads.HeldFile` (its `path`, `fd` and `read_bytes`).

    Returns:
        The `SafetensorsHeader`.

    Raises:
        WeightFileError: the file breaks a rule of the format (see the module
            docstring); the message names the file and the rule.
    """
    path = file.path
    size = os.fstat(file.fd).st_size
    if size < LENGTH_BYTES:
        raise _invalid(
            path,
            f"it is {size} bytes long, shorter than the {LENGTH_BYTES}-byte "
            "header length every safetensors file starts with",
            f"file size {size}",
        )
    (length,) = struct.unpack("<Q", file.read_bytes(0, LENGTH_BYTES))
    if length > MAX_HEADER_BYTES:
        raise _invalid(
            path,
            f"its header length is over safetensors' limit of {MAX_HEADER_BYTES} bytes",
            f"header length {length}",
        )
    if LENGTH_BYTES + length > size:
        raise _invalid(
            path,
            "its header length runs past the end of the file (the file is "
            "truncated, or not a safetensors file)",
            f"header length {length}, file size {size}",
        )
    header = _parse_json(path, file.read_bytes(LENGTH_BYTES, length))
    metadata = _metadata(path, header.pop(METADATA_KEY, None))
    tensors = {name: _entry(path, name, value) for name, value in header.items()}
    _check_tiling(path, tensors, size - LENGTH_BYTES - length)
    return SafetensorsHeader(tensors, metadata, LENGTH_BYTES + length)


def _invalid(path, problem, received) -> WeightFileError:
    return WeightFileError(
        f"{path} is not a valid safetensors file: {problem}. safetensors' own "
        "reader refuses it too; download or convert the checkpoint again. "
        f"Received: {received}"
    )


def _parse_json(path, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _invalid(path, "its header is not UTF-8 text", str(error)) from error

    def unique(pairs):
        found = {}
        for key, value in pairs:
            if key in found:
                raise _invalid(path, "its header names a key twice", repr(key))
            found[key] = value
        return found

    def no_constant(name):
        raise _invalid(path, "its header holds a number JSON does not have", name)

    try:
        header = json.loads(text, object_pairs_hook=unique, parse_constant=no_constant)
    except WeightFileError:
        raise
    except (ValueError, RecursionError) as error:  # numbers too long, nesting
        raise _invalid(path, "its header is not valid JSON", str(error)) from error
    if not isinstance(header, dict):
        raise _invalid(
            path,
            "its header is not a JSON object of tensors",
            f"a JSON {type(header).__name__}",
        )
    return header


def _metadata(path, value) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(v, str) for v in value.values()
    ):
        raise _invalid(
            path,
            f"its {METADATA_KEY!r} is not an object of strings",
            f"{METADATA_KEY}={_short(value)}",
        )
    return value


def _is_count(value) -> bool:
    return type(value) is int and 0 <= value <= MAX_INTEGER


def _entry(path, name, value) -> TensorEntry:
    def bad(problem):
        return _invalid(
            path, f"tensor {name!r} {problem}", f"{name!r}: {_short(value)}"
        )

    if not isinstance(value, dict):
        raise bad("is not an object with dtype, shape and data_offsets")
    missing = [field for field in _ENTRY_FIELDS if field not in value]
    if missing:
        raise bad(f"has no {', '.join(missing)}")
    dtype, shape, offsets = (value[field] for field in _ENTRY_FIELDS)
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"has a dtype safetensors does not know (one of {list(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad("has a shape that is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(n) for n in offsets)
    ):
        raise bad("has data_offsets that are not two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise bad("has data_offsets that end before they begin")
    if any(n > sys.maxsize for n in shape):
        raise bad(f"has an axis longer than numpy can index ({sys.maxsize})")
    elements = 1
    for n in shape:  # as safetensors: the first product past 2**64 overflows
        elements *= n
        if elements > MAX_INTEGER:
            raise bad("has a shape whose element count overflows")
    bits = elements * DTYPE_BITS[dtype]
    if bits // 8 > MAX_INTEGER:
        raise bad("has a shape whose byte size overflows")
    if bits % 8:
        raise bad("has a sub-byte dtype whose elements do not fill whole bytes")
    if bits // 8 != end - begin:
        raise bad(
            f"spans {end - begin} bytes, but its shape and dtype need {bits // 8}"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_tiling(path, tensors: dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors, sorted by offsets, cover the data buffer exactly once."""
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: _span(item[1])):
        if entry.begin != position:
            problem = (
                "overlaps the tensor before it (two tensors share bytes)"
                if entry.begin < position
                else "leaves a gap before it"
            )
            raise _invalid(
                path,
                f"tensor {name!r} {problem}: in offset order, each tensor "
                "begins where the one before ends",
                f"data_offsets={[entry.begin, entry.end]} of {name!r}, expected "
                f"it to begin at {position}",
            )
        position = entry.end
    if position != data_bytes:
        raise _invalid(
            path,
            "its tensors do not cover the data after the header exactly "
            "(bytes past the last tensor, or tensors past the end of the file)",
            f"tensors end at {position}, data is {data_bytes} bytes",
        )


def _span(entry: TensorEntry) -> tuple[int, int]:
    return entry.begin, entry.end


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
