"""The floor of every load: read each tensor of a preset's weight files once,
in one thread, as a plain loader must."""

from __future__ import annotations

import glob
import os


def weight_files(path: str) -> list[str]:
    """The preset's `.h5` files, then its `.safetensors` files."""
    return sorted(glob.glob(os.path.join(path, "*.h5"))) + sorted(
        glob.glob(os.path.join(path, "*.safetensors"))
    )


def read_file_only(path: str) -> int:
    """Read every tensor of the weight files once; returns the bytes read."""
    import h5py
    import numpy as np

    total = 0
    for name in weight_files(path):
        if name.endswith(".h5"):
            with h5py.File(name, "r") as f:

                def visit(_, node):
                    nonlocal total
                    if isinstance(node, h5py.Dataset):
                        total += np.asarray(node[()]).nbytes

                f.visititems(visit)
        else:
            from safetensors import safe_open

            with safe_open(name, framework="np") as f:
                for key in f.keys():
                    total += f.get_tensor(key).nbytes
    return total
