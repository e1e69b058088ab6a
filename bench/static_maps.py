"""Evaluate keras-hub's static `get_layout_map` on our weight tables.

keras-hub's maps are applied to the weight table of a config, for any mesh
size (fake device names: nothing is placed). A weight whose sharded
dimension does not divide is reported as the `IndivisibleError` that loading
would raise; a weight no key matches is replicated.
"""

from __future__ import annotations

import math

import keras
import keras_hub
import numpy as np

STATIC_MAPS = {
    "GemmaBackbone": keras_hub.models.GemmaBackbone.get_layout_map,
    "LlamaBackbone": keras_hub.models.LlamaBackbone.get_layout_map,
    "Llama3Backbone": keras_hub.models.LlamaBackbone.get_layout_map,
}


def fake_mesh(shape, names=("batch", "model")):
    devices = np.array([f"cpu:{i}" for i in range(math.prod(shape))]).reshape(shape)
    return keras.distribution.DeviceMesh(shape, names, devices)


def static_device_bytes(backbone_class, weights, shape, itemsize=4):
    """Per-device bytes under keras-hub's map, or the reason it can't load."""
    get_map = STATIC_MAPS.get(backbone_class)
    if get_map is None:
        return None, "no static map"
    mesh = fake_mesh(shape)
    layout_map = get_map(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    total, replicated = 0, 0
    for weight in weights:
        layout = layout_map[weight.path]
        size = math.prod(weight.shape) * itemsize
        if layout is None:
            total += size
            replicated += size
            continue
        shards = 1
        for axis, dim in zip(layout.axes, weight.shape):
            if axis is None:
                continue
            if dim % sizes[axis]:
                return None, f"fails: IndivisibleError ({weight.path} {weight.shape})"
            shards *= sizes[axis]
        total += size // shards
    note = f"{replicated / 2**20:.0f} MiB unmatched, replicated" if replicated else ""
    return total, note
