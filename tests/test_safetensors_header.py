"""Safetensors headers are checked as strictly as safetensors' own reader.

Each malformed file below is refused by `safetensors.safe_open` (checked
first, so the case is a real one) and by `SafetensorsFile` with one
`WeightFileError` that names the file; each well-formed one loads the same
values with both. Four refused files are also loaded end to end with
`device_mesh=`, where they used to load aliased or shifted weights.
"""

import json
import os
import shutil
import struct

import hf_checkpoints
import keras_hub
import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors import safe_open

from keras_hub_autodist.errors import WeightFileChangedError
from keras_hub_autodist.errors import WeightFileError
from keras_hub_autodist.lazy_tensors import SafetensorsFile

MESH = {"batch": 2, "model": 4}


def f32(shape, begin, end=None):
    count = int(np.prod(shape))
    return {
        "dtype": "F32",
        "shape": list(shape),
        "data_offsets": [begin, begin + 4 * count if end is None else end],
    }


def write_file(path, header, data, raw=None, length=None):
    """A safetensors file of `header` (a dict, or `raw` bytes) and `data`."""
    text = json.dumps(header).encode() if raw is None else raw
    length = len(text) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length) + text + data)
    return str(path)


# name -> (header, data, raw header bytes or None, header length or None)
REFUSED = {
    "two tensors on the same bytes": ({"a": f32([2], 0), "b": f32([2], 0)}, 8),
    "one tensor inside another": ({"a": f32([4], 0), "b": f32([1], 4)}, 16),
    "overlapping tensors": ({"a": f32([2], 0), "b": f32([2], 4)}, 12),
    "an offset off its element boundary": (
        {"a": f32([2], 0), "b": f32([2], 6)},
        14,
    ),
    "a gap before the first tensor": ({"a": f32([1], 2)}, 6),
    "data past the last tensor": ({"a": f32([1], 0)}, 8),
    "a tensor past the end of the file": ({"a": f32([2], 0)}, 4),
    "data and no tensor": ({}, 4),
    "offsets that end before they begin": ({"a": f32([0], 4, 0)}, 4),
    "a span that does not match the shape": ({"a": f32([2], 0, 4)}, 4),
    "a shape whose size overflows": ({"a": f32([2**62, 2**62], 0, 4)}, 4),
    "an unknown dtype": ({"a": {**f32([1], 0), "dtype": "f32"}}, 4),
    "a dtype that is not a string": ({"a": {**f32([1], 0), "dtype": 4}}, 4),
    "a float in the shape": ({"a": {**f32([1], 0), "shape": [1.0]}}, 4),
    "a boolean in the shape": ({"a": {**f32([1], 0), "shape": [True]}}, 4),
    "a negative dimension": ({"a": {**f32([1], 0), "shape": [-1]}}, 4),
    "a shape that is no list": ({"a": {**f32([1], 0), "shape": 1}}, 4),
    "three offsets": ({"a": {**f32([1], 0), "data_offsets": [0, 4, 8]}}, 4),
    "a negative offset": ({"a": {**f32([1], 0), "data_offsets": [-4, 0]}}, 4),
    "an offset past 2**64": (
        {"a": {**f32([1], 0), "data_offsets": [2**64, 2**64 + 4]}},
        4,
    ),
    "a missing field": ({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, 4),
    "a tensor that is no object": ({"a": [0, 4]}, 0),
    "metadata that are no strings": (
        {"__metadata__": {"format": 1}, "a": f32([1], 0)},
        4,
    ),
    "metadata that are no object": ({"__metadata__": [], "a": f32([1], 0)}, 4),
    "a sub-byte tensor of a fractional byte": (
        {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
        2,
    ),
    "a header that is no object": (None, 0, b"[]"),
    "a header that is no JSON": (None, 0, b'{"a": '),
    "a header that is no UTF-8": (None, 0, b'{"\xff": 1}'),
    "a header with a NaN": (
        None,
        4,
        b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
    ),
    "a name given twice": (
        None,
        8,
        json.dumps({"a": f32([1], 0)}).encode()[:-1]
        + b', "a": '
        + json.dumps(f32([1], 4)).encode()
        + b"}",
    ),
    "trailing bytes after the JSON": (None, 0, b"{}\x00"),
    "a header length past the end of the file": (None, 0, b"{}", 100),
    "a header length over 100 MB": (None, 0, b"{}", 100_000_001),
    "a header length of 2**63": (None, 0, b"{}", 2**63),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_header_safetensors_refuses_is_a_weight_file_error(tmp_path, case):
    header, size, *rest = REFUSED[case]
    raw = rest[0] if rest else None
    length = rest[1] if len(rest) > 1 else None
    path = write_file(tmp_path / "model.safetensors", header, bytes(size), raw, length)
    with pytest.raises(SafetensorError):  # the case is one safetensors refuses
        with safe_open(path, "np"):
            pass
    with pytest.raises(WeightFileError, match="is not a valid safetensors file") as e:
        SafetensorsFile(path)
    assert not isinstance(e.value, WeightFileChangedError)
    assert str(e.value).startswith(path)
    assert "Received: " in str(e.value)


def test_a_file_shorter_than_its_header_length_is_not_a_file_that_changed(
    tmp_path,
):
    path = write_file(tmp_path / "model.safetensors", None, b"", b"{}", 64)
    with pytest.raises(WeightFileError, match="past the end of the file") as e:
        SafetensorsFile(path)
    assert "changed" not in str(e.value) and "modified" not in str(e.value)


ACCEPTED = {
    "tensors in any order": ({"b": f32([1], 8), "a": f32([2], 0)}, 12),
    "a tensor off the item size of the one before": (
        {
            "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
            "b": f32([1], 2),
        },
        6,
    ),
    "empty tensors": (
        {"a": f32([0], 0), "b": f32([0, 3], 0), "c": f32([1], 0)},
        4,
    ),
    "a scalar": ({"a": f32([], 0)}, 4),
    "no tensor": ({}, 0),
    "null metadata": ({"__metadata__": None, "a": f32([1], 0)}, 4),
    "string metadata": ({"__metadata__": {"format": "pt"}, "a": f32([1], 0)}, 4),
    "unknown fields": ({"a": {**f32([1], 0), "note": 1}}, 4),
    "blanks around the JSON": (
        None,
        4,
        b'  {"a": ' + json.dumps(f32([1], 0)).encode() + b"}  ",
    ),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_a_header_safetensors_accepts_loads_the_same_values(tmp_path, case):
    header, size, *raw = ACCEPTED[case]
    data = np.random.default_rng(0).integers(0, 255, size, np.uint8).tobytes()
    path = write_file(tmp_path / "model.safetensors", header, data, *raw)
    with safe_open(path, "np") as reference:
        expected = {name: reference.get_tensor(name) for name in reference.keys()}
        metadata = reference.metadata()
    with SafetensorsFile(path) as file:
        assert file.keys() == sorted(expected)
        assert file.metadata() == metadata
        for name, values in expected.items():
            np.testing.assert_array_equal(file.read(name), values, err_msg=name)


# End to end: a Hugging Face checkpoint whose header was edited.


def read_file(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    return header, data


def aliased(header, data):
    """The second norm of layer 0 on the bytes of the first."""
    first = header["model.layers.0.input_layernorm.weight"]["data_offsets"]
    header["model.layers.0.post_attention_layernorm.weight"]["data_offsets"] = first
    return header, data


def inside(header, data):
    """The final norm on bytes inside the output embedding."""
    begin = header["lm_head.weight"]["data_offsets"][0] + 128
    header["model.norm.weight"]["data_offsets"] = [begin, begin + 4 * 32]
    return header, data


def shifted(header, data):
    """A tensor's offsets moved by half an element."""
    name = "model.layers.0.self_attn.q_proj.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 2, end + 2]
    return header, data


def padded(header, data):
    return header, data + bytes(16)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    return hf_checkpoints.llama3(tmp_path_factory.mktemp("headers") / "llama")


@pytest.mark.parametrize("edit", [aliased, inside, shifted, padded])
def test_a_checkpoint_safetensors_refuses_does_not_load_with_a_mesh(
    llama_checkpoint, tmp_path, edit
):
    path = tmp_path / "llama"
    shutil.copytree(llama_checkpoint, path)
    weights = os.path.join(path, "model.safetensors")
    header, data = edit(*read_file(weights))
    write_file(weights, header, data)
    with pytest.raises(SafetensorError):
        with safe_open(weights, "np"):
            pass
    with pytest.raises(WeightFileError, match=f"{weights} is not a valid"):
        keras_hub.models.Backbone.from_preset(str(path), device_mesh=MESH)
