"""The floor of every load: read each tensor of a preset's weight files once,
in one thread, as a plain loader must.

A loader keeps what it reads, so its memory is fresh: on a machine where
first touching memory is dear (a virtual machine whose host reclaims idle
pages), keeping every tensor costs more than reading them one at a time
into memory freed and reused. Both floors are measured; the loading bench
runs the keeping one without numpy's transparent-huge-page advice, whose
memory compaction would make it slower still."""

from __future__ import annotations

import glob
import os

# The floors' variant names in the loading bench → whether they keep what
# they read.
FILE_READS = {
    "read the file only": False,
    "read the file, keeping every tensor": True,
}


def weight_files(path: str) -> list[str]:
    """The preset's `.h5` files, then its `.safetensors` files."""
    return sorted(glob.glob(os.path.join(path, "*.h5"))) + sorted(
        glob.glob(os.path.join(path, "*.safetensors"))
    )


def read_file_only(path: str, keep: bool = False) -> int:
    """Read every tensor of the weight files once; returns the bytes read.

    Args:
        path: the preset folder.
        keep: hold every tensor until all are read (as a loader does),
            instead of freeing each before the next.
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
                    total += values.nbytes
                    if keep:
                        kept.append(values)
    return total
