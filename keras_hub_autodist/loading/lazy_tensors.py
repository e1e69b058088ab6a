"""Tensors of weight files, read slice by slice at their file offsets.

Keras stores each weight of a `.h5` preset as a contiguous HDF5 dataset, and
a `.safetensors` file is an 8-byte header length, a JSON header of offsets
and then the raw tensors. Either way a slice of a weight is a set of byte
ranges of the file, read in parallel by `file_reads.ContiguousTensor` from
one `HeldFile` per file, so a file replaced on disk meanwhile is still read
from the version first opened, as Keras' own open HDF5 file is.

Example:
```python
with SafetensorsFile("model.safetensors") as file:
    tensor = file.get_tensor(file.keys()[0])
```
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from keras_hub_autodist.errors import WeightFileError
from keras_hub_autodist.loading.file_reads import ContiguousTensor
from keras_hub_autodist.loading.file_reads import HeldFile
from keras_hub_autodist.loading.file_reads import ReadBySlices
from keras_hub_autodist.loading.file_reads import convert
from keras_hub_autodist.loading.hook_views import HookView
from keras_hub_autodist.loading.safetensors_header import read_header

# The dtypes of the safetensors format, as numpy reads them.
SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


def h5_contiguous_offset(dataset) -> int | None:
    """The file offset of an HDF5 dataset's values, or `None` when they are
    not stored as one plain contiguous block (chunked, compressed, external,
    not yet written, or of a byte order other than this machine's)."""
    try:
        if dataset.chunks is not None or dataset.external:
            return None
        if dataset.id.get_create_plist().get_nfilters():
            return None
        offset = dataset.id.get_offset()
    except Exception:  # an h5py without these queries, or a virtual dataset
        return None
    if offset is None:
        return None
    dtype = dataset.dtype
    if dtype.kind not in "biufV" or dtype.byteorder == (
        ">" if np.little_endian else "<"
    ):
        return None
    nbytes = math.prod(dataset.shape) * dtype.itemsize
    if dataset.id.get_storage_size() != nbytes:
        return None
    return int(offset)


class LazyH5Dataset(ReadBySlices):
    """An HDF5 dataset of a Keras weight file, read slice by slice on demand.

    Keras' weight store returns one of these instead of a full numpy array
    while `sharded_loading` is active. A contiguous dataset (what Keras
    writes) is read by file offset from a `HeldFile`; any other through
    h5py, from the dataset Keras opened. `np.asarray(dataset)` reads it
    whole.

    Args:
        dataset: the `h5py.Dataset`, from the file Keras opened.
        dtype: the numpy dtype of its values (`bfloat16` for Keras'
            bfloat16 datasets, stored as 2-byte opaque values).
        file: the `HeldFile` of the dataset's file, or `None` to read
            through h5py.
    """

    def __init__(self, dataset, dtype, file: HeldFile | None = None):
        self.dataset = dataset
        self.name = dataset.name
        self.shape = tuple(dataset.shape)
        self.dtype = np.dtype(dtype)
        offset = h5_contiguous_offset(dataset) if file is not None else None
        self.contiguous = (
            None
            if offset is None
            else ContiguousTensor(file, offset, self.shape, self.dtype)
        )

    def read_slices(
        self, indices: list, executor=None, dtype=None, outputs=None
    ) -> list[np.ndarray]:
        """Read each index of `indices` (tuples of slices), cast to `dtype`
        (`None`: the dataset's), into `outputs` when given (see
        `ContiguousTensor.read_slices`)."""
        if self.contiguous is not None:
            return self.contiguous.read_slices(indices, executor, dtype, outputs)
        values = []
        for number, index in enumerate(indices):
            part = np.asarray(self.dataset[tuple(index)] if index else self.dataset[()])
            if part.dtype != self.dtype:  # Keras' bfloat16: opaque 2-byte values
                part = part.view(self.dtype)
            if outputs is not None:
                convert(part, outputs[number])  # cast as it is copied
                part = outputs[number]
            elif dtype is not None:
                part = part.astype(dtype, copy=False)
            values.append(part)
        return values

    def __repr__(self):
        return f"<LazyH5Dataset {self.name} shape={self.shape}>"


class SafetensorsFile:
    """A safetensors file read by offset from one held descriptor.

    `safetensors.safe_open` maps the whole file for as long as it is open,
    and every page a read touches stays in the process's resident memory
    until the file is closed. keras-hub's `SafetensorLoader` keeps each file
    open for the whole load, so host RSS grew by the whole checkpoint. While
    `sharded_loading` is active, keras-hub's loader gets one of these
    instead: the header is parsed once, and checked as strictly as
    safetensors' own reader checks it (`safetensors_header.py`), and each
    tensor is read with `os.preadv` into its own buffer; nothing is mapped.

    Args:
        path: the `*.safetensors` file.
        framework: the framework of the tensors returned (only `"np"`).
        file: the `HeldFile` to read from (one per path for a whole load);
            by default the file is opened here and closed by `close()`.

    Example:
    ```python
    with SafetensorsFile("model.safetensors") as file:
        tensor = file.get_tensor(file.keys()[0])
    ```
    """

    def __init__(self, path, framework: str = "np", file: HeldFile | None = None):
        if framework not in ("np", "numpy"):
            raise ValueError(
                "Sharded loading reads safetensors files as numpy arrays. "
                f"Received: framework={framework!r}"
            )
        self.path = str(path)
        self._owned = file is None
        self.file = HeldFile(self.path) if file is None else file
        try:
            # Checked as safetensors' own reader checks it (WeightFileError).
            header = read_header(self.file)
        except BaseException:
            self.close()
            raise
        self._metadata = header.metadata
        self._start = header.data_start
        self._tensors = header.tensors
        # Set by the loading session: the tensor `get_tensor` returns (lazy
        # or read) and the executor reads run on.
        self.get_lazy = None
        self.executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self) -> None:
        """Close the file if this object opened it."""
        if self._owned:
            self.file.close()

    def keys(self) -> list:
        """The tensor names in the file, sorted as `safe_open` lists them."""
        return sorted(self._tensors)

    def metadata(self):
        """The file's metadata."""
        return self._metadata

    def tensor(self, name: str) -> ContiguousTensor:
        """Tensor `name`, unread."""
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyError(name)
        dtype = SAFETENSORS_DTYPES.get(entry.dtype)
        if dtype is None:
            raise WeightFileError(
                f"{self.path}: tensor {name!r} has a dtype numpy can't hold, so "
                "it can't be loaded as a Keras weight; convert the checkpoint "
                f"to another dtype. Received: dtype={entry.dtype!r}"
            )
        return ContiguousTensor(
            self.file, self._start + entry.begin, entry.shape, dtype
        )

    def get_tensor(self, name: str):
        """Tensor `name`, read whole (or a `LazySafetensor` when the loading
        session asks for one: `assign` then reads each device's slice)."""
        if self.get_lazy is not None:
            lazy = self.get_lazy(self, name)
            if lazy is not None:
                return lazy
        return self.read(name)

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """Read `index` (a tuple of slices; `None`: all) of tensor `name`."""
        return self.tensor(name).read(index, self.executor)


class LazySafetensor:
    """A tensor of a safetensors file, read slice by slice on demand.

    keras-hub's `port_weight` hands one of these to `assign` when it
    converts nothing (no hook) while `sharded_loading` is active, so each
    device's slice is read straight from the file and no whole copy exists
    on the host. `np.asarray(tensor)` still reads it whole.

    Args:
        file: the `SafetensorsFile` holding it.
        name: the tensor's name in the file.
    """

    def __init__(self, file: SafetensorsFile, name: str):
        self.file = file
        self.name = name
        self._tensor = file.tensor(name)
        self.shape = self._tensor.shape
        self.dtype = self._tensor.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read_slices(
        self, indices: list, executor=None, dtype=None, outputs=None
    ) -> list[np.ndarray]:
        """Read each index of `indices` (tuples of slices), cast to `dtype`
        (`None`: the tensor's), into `outputs` when given (see
        `ContiguousTensor.read_slices`)."""
        return self._tensor.read_slices(indices, executor, dtype, outputs)

    def read(self, index: tuple | None = None) -> np.ndarray:
        """Read `index` (a tuple of slices; `None`: all) of the tensor."""
        return self._tensor.read(index, self.file.executor)

    def __array__(self, dtype=None, copy=None):
        values = self.read()
        return values if dtype is None else values.astype(dtype)

    def __repr__(self):
        return f"<LazySafetensor {self.file.path}:{self.name} shape={self.shape}>"


# The tensors `assign` receives unread: `put` reads each device's slice.
LAZY_TENSORS = (LazyH5Dataset, LazySafetensor, HookView)
