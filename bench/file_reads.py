"""The floor of every load: read each tensor of a preset's weight files once,
in one thread, as a plain loader must.

A loader keeps what it reads, so its memory is fresh: on a machine where
first touching memory is dear (a virtual machine whose host reclaims idle
pages), keeping every tensor costs more than reading them one at a time
into memory freed and reused. Both floors are measured; the loading bench
runs the keeping one without numpy's transparent-huge-page advice, whose
memory compaction would make it slower still. For a Hugging Face checkpoint
a third floor keeps its linear weights in Keras' layout (transposed), which
keras-hub's converter asks of any loader."""

from __future__ import annotations

import glob
import os

# The floors' variant names in the loading bench → `read_file_only`'s
# arguments.
FILE_READS = {
    "read the file only": {},
    "read the file, keeping every tensor": {"keep": True},
    "read the file, keeping every tensor in Keras' layout": {
        "keep": True,
        "keras_layout": True,
    },
}
# A Hugging Face linear layer's weight is `(out, in)`; Keras' kernel is
# `(in, out)` (or a reshape of it): keras-hub's converter transposes them.
TRANSPOSED_IN_KERAS = ("_proj.weight", "lm_head.weight")


def weight_files(path: str) -> list[str]:
    """The preset's `.h5` files, then its `.safetensors` files."""
    return sorted(glob.glob(os.path.join(path, "*.h5"))) + sorted(
        glob.glob(os.path.join(path, "*.safetensors"))
    )


def read_file_only(path: str, keep: bool = False, keras_layout: bool = False) -> int:
    """Read every tensor of the weight files once; returns the bytes read.

    Args:
        path: the preset folder.
        keep: hold every tensor until all are read (as a loader does),
            instead of freeing each before the next.
        keras_layout: copy each Hugging Face linear weight into Keras'
            kernel layout (its transpose, `TRANSPOSED_IN_KERAS`), as any
            loader through keras-hub's converter must.
    """
    import h5py
    import numpy as np

    total, kept = 0, []
    for name in weight_files(path):
        if name.endswith(".h5"):
            with h5py.File(name, "r") as f:

                def visit(_, node):
                    nonlocal total
                    if isinstance(node, h5py.Dataset):
                        values = np.asarray(node[()])
                        total += values.nbytes
                        if keep:
                            kept.append(values)

                f.visititems(visit)
        else:
            from safetensors import safe_open

            with safe_open(name, framework="np") as f:
                for key in f.keys():
                    values = f.get_tensor(key)
                    if keras_layout and key.endswith(TRANSPOSED_IN_KERAS):
                        values = transposed(values)
                    total += values.nbytes
                    if keep:
                        kept.append(values)
    return total


# Rows and columns of the tiles `transposed` copies: a strided copy of the
# whole matrix walks memory across rows and is about 2x slower.
TILE = 128


def transposed(values):
    """A C-contiguous transpose of a 2-D array, copied tile by tile."""
    import numpy as np

    rows, columns = values.shape
    result = np.empty((columns, rows), values.dtype)
    for row in range(0, rows, TILE):
        for column in range(0, columns, TILE):
            result[column : column + TILE, row : row + TILE] = values[
                row : row + TILE, column : column + TILE
            ].T
    return result
