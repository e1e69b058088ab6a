"""Byte ranges of a weight file, read in parallel into aligned buffers.

A slice of a contiguous tensor is a set of byte ranges of its file. They are
read with `os.preadv` straight into the buffer that becomes a device's
shard: no library in between, the GIL released during every read, and many
reads at once from a thread pool.

A file is read through one `HeldFile`, a descriptor kept open for the whole
load. A file replaced on disk (`os.replace`) or deleted meanwhile is still
read from the version first opened; a file modified in place is caught by
`HeldFile.check_unchanged`. Nothing is memory-mapped, so the host holds only
the slices being read.

Buffers are aligned to 64 bytes: JAX's CPU backend then adopts them as
device memory without a copy. Each read task first faults in the pages it
is about to fill (`populate`), so that the kernel's zeroing of fresh memory,
which costs more than the copy from the page cache, runs on every reading
thread at once. A slice wanted in a wider or narrower dtype than the file's
is cast by the same tasks, so each output byte is written once.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import mmap
import os
import sys

import ml_dtypes
import numpy as np

from keras_hub_autodist.errors import WeightFileChangedError

# A read task covers about this many bytes of the file.
READ_CHUNK_BYTES = 8 * 1024**2
# A slice whose contiguous runs are shorter than this, and many, is read by
# blocks of whole rows shared by every slice of the weight, instead of one
# read per run.
SMALL_RUN_BYTES = 64 * 1024
SMALL_RUN_COUNT = 64
# numpy copies an array element by element in the target's order. From a
# transposed source, each element of a target row comes from another source
# row: copied by blocks of this many columns, the source rows one block
# walks stay in the first-level cache until their next elements are copied
# (2.4x faster for a bfloat16 Gemma FFN kernel).
TRANSPOSE_TILE = 256
# Buffers are aligned so that JAX's CPU client can adopt them without a copy.
BUFFER_ALIGNMENT = 64
# Buffers of at least this size are anonymous mappings of their own.
MAPPED_BUFFER_BYTES = 1024**2

_RAW_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Linux >= 5.14: fault a range of pages in for writing, in the calling
# thread. Older kernels refuse it and the writes fault the pages in instead.
_MADV_POPULATE_WRITE = 23


def _libc_madvise():
    """libc's `madvise`, or `None` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def read_threads() -> int:
    """How many threads read weight files at once."""
    return max(2, min(16, os.cpu_count() or 1))


def aligned_empty(shape, dtype, zeros: bool = False) -> np.ndarray:
    """A C-contiguous array whose data starts on a `BUFFER_ALIGNMENT` boundary.

    A large one is a private anonymous mapping of its own, filled in by the
    kernel in one call (`MAP_POPULATE`) unless `zeros` asks for untouched
    zero pages, and unmapped when the last reference to it goes. This skips
    numpy's transparent-huge-page advice, whose page faults can stall on
    memory compaction for seconds per GiB, and leaves nothing in the heap
    for `malloc_trim` to return.

    Example:
    >>> aligned_empty((3, 4), "float32").ctypes.data % BUFFER_ALIGNMENT
    0
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= MAPPED_BUFFER_BYTES:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if not zeros:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(-1, nbytes, flags=flags)
        return np.frombuffer(mapping, dtype, math.prod(shape)).reshape(shape)
    raw = (np.zeros if zeros else np.empty)(nbytes + BUFFER_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % BUFFER_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def populate(array: np.ndarray, start: int, stop: int) -> None:
    """Fault in bytes `[start, stop)` of `array`'s memory before they are
    written, so that threads filling parts of one buffer also share the
    kernel's work of zeroing its fresh pages. Best effort: where the kernel
    can't, the writes fault the pages in.

    Example:
    >>> buffer = aligned_empty((1024,), "float32", zeros=True)
    >>> populate(buffer, 0, buffer.nbytes)
    """
    if _MADVISE is None or stop <= start:
        return
    address = array.ctypes.data + start
    first_page = address - address % mmap.PAGESIZE
    _MADVISE(first_page, address + (stop - start) - first_page, _MADV_POPULATE_WRITE)


def convert(source: np.ndarray, target: np.ndarray) -> None:
    """Write `source` into `target` (same shape), cast to `target`'s dtype,
    in numpy loops that release the GIL.

    bfloat16 is the top half of a float32, so widening it is a shift of
    its bits. A source strided along its last axis (a converter's
    transposed view) is copied by blocks of `TRANSPOSE_TILE` columns.

    Example:
    >>> target = np.empty(2, "float32")
    >>> convert(np.array([1.5, -2], ml_dtypes.bfloat16), target)
    >>> target.tolist()
    [1.5, -2.0]
    """
    columns = target.shape[-1] if target.ndim > 1 else 0
    if columns > TRANSPOSE_TILE and source.strides[-1] != source.itemsize:
        for start in range(0, columns, TRANSPOSE_TILE):
            block = slice(start, start + TRANSPOSE_TILE)
            _convert(source[..., block], target[..., block])
        return
    _convert(source, target)


def _convert(source: np.ndarray, target: np.ndarray) -> None:
    if source.dtype == target.dtype:
        _raw(target)[...] = _raw(source)
    elif source.dtype == ml_dtypes.bfloat16 and target.dtype == np.float32:
        np.left_shift(
            source.view(np.uint16), 16, out=target.view(np.uint32), dtype=np.uint32
        )
    else:
        target[...] = source


def local_shape(index: tuple, shape: tuple) -> tuple:
    """The shape of `index` (a tuple of slices) of an array of `shape`."""
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _raw(array: np.ndarray) -> np.ndarray:
    """`array` viewed as unsigned integers of its item size, so that copies
    run in numpy's plain loops (with the GIL released) for any dtype."""
    raw = _RAW_DTYPES.get(array.dtype.itemsize, f"V{array.dtype.itemsize}")
    return array.view(raw)


class HeldFile:
    """One open descriptor of a weight file, kept for a whole load.

    Every read is an `os.preadv` at an offset, so threads share the
    descriptor. The file's identity and size are recorded when it is opened:
    `check_unchanged` raises `WeightFileChangedError` if it was modified in
    place since.

    Args:
        path: the file.
        fd: an open descriptor of it to take over (e.g. duplicated from
            another library's handle); by default `path` is opened.

    Example:
    ```python
    with HeldFile("model.safetensors") as file:
        header_length = file.read_bytes(0, 8)
    ```
    """

    def __init__(self, path: str, fd: int | None = None):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        self.identity = self._identity()

    def _identity(self) -> tuple:
        status = os.fstat(self.fd)
        return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def same_file(self, fd: int) -> bool:
        """Whether descriptor `fd` refers to the same file as this one."""
        status = os.fstat(fd)
        return (status.st_dev, status.st_ino) == self.identity[:2]

    def read_into(self, buffer, offset: int) -> None:
        """Fill `buffer` (a writable bytes-like object) from `offset`."""
        if isinstance(buffer, np.ndarray):
            buffer = buffer.view(np.uint8).reshape(-1)  # contiguous: no copy
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            count = os.preadv(self.fd, [view[done:]], offset + done)
            if count == 0:
                raise WeightFileChangedError(
                    f"{self.path} ended at byte {offset + done} while a weight "
                    "was read from it; it was truncated or rewritten during "
                    "the load. Load again once it is complete. Received: "
                    f"{len(view) - done} bytes missing."
                )
            done += count

    def read_bytes(self, offset: int, count: int) -> bytes:
        """`count` bytes from `offset`."""
        buffer = bytearray(count)
        self.read_into(buffer, offset)
        return bytes(buffer)

    def check_unchanged(self) -> None:
        """Raise `WeightFileChangedError` if the file changed since opened."""
        now = self._identity()
        if now != self.identity:
            raise WeightFileChangedError(
                f"{self.path} was modified while a model was loaded from it, "
                "so the loaded weights may mix two versions of it. Load "
                "again once the file is complete; replace weight files with "
                "`os.replace` rather than writing them in place. Received: "
                f"size {self.identity[2]} -> {now[2]} bytes, modification "
                f"time {self.identity[3]} -> {now[3]} ns."
            )

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            self.close()


def run_tasks(tasks: list, executor) -> None:
    """Run `tasks` (callables), on `executor` when there is more than one."""
    if executor is None or len(tasks) < 2:
        for task in tasks:
            task()
        return
    futures = [executor.submit(task) for task in tasks]
    try:
        for future in concurrent.futures.as_completed(futures):
            future.result()
    finally:
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)


def _check_outputs(indices: list, shape: tuple, dtype: np.dtype, outputs: list):
    """Raise `ValueError` unless `outputs` can receive `indices` of an array
    of `shape`, as `dtype`."""
    wanted = [local_shape(index, shape) for index in indices]
    received = [(tuple(o.shape), o.dtype, o.flags.c_contiguous) for o in outputs]
    if received != [(w, dtype, True) for w in wanted]:
        raise ValueError(
            "Slices are read into C-contiguous arrays of their shape and "
            f"dtype. Expected: {[(w, str(dtype)) for w in wanted]}. Received: "
            f"{[(r[0], str(r[1]), 'C' if r[2] else 'strided') for r in received]}"
        )


def copy_slices(source, indices: list, outputs: list, executor=None) -> list:
    """Copy each index of host array `source` into its array of `outputs`
    (cast to its dtype), on `executor`: a converter's tensor is often a
    transposed view, whose copy is slow in one thread.

    Returns:
        `outputs`.

    Example:
    >>> copy_slices(np.arange(4).reshape(2, 2).T, [(slice(0, 1),)],
    ...             [np.empty((1, 2), "float32")])[0].tolist()
    [[0.0, 2.0]]
    """
    tasks = [
        functools.partial(convert, np.asarray(source[index]), output)
        for index, output in zip(indices, outputs)
    ]
    run_tasks(tasks, executor)
    return outputs


def _runs(shape: tuple, index: tuple):
    """The contiguous runs of `index` in a C-ordered array of `shape`.

    Returns:
        `(first, outer, run)`: the element offset of the first run, the
        element offsets of every run from the first (in output order), and
        the elements of each run.
    """
    ndim = len(shape)
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
    split = 0  # dimensions from `split` on form one run
    for axis in range(ndim - 1, -1, -1):
        split = axis
        start, stop = bounds[axis]
        if (start, stop) != (0, shape[axis]):
            break
    strides = [math.prod(shape[axis + 1 :]) for axis in range(ndim)]
    run = (bounds[split][1] - bounds[split][0]) * strides[split] if ndim else 1
    first = sum(bounds[axis][0] * strides[axis] for axis in range(ndim))
    outer = np.zeros(1, np.int64)
    for axis in range(split):
        extent = np.arange(bounds[axis][1] - bounds[axis][0], dtype=np.int64)
        outer = (outer[:, None] + extent[None, :] * strides[axis]).reshape(-1)
    return first, outer, run


def _short_runs(outer, run: int, itemsize: int) -> bool:
    return run * itemsize < SMALL_RUN_BYTES and len(outer) > SMALL_RUN_COUNT


def has_short_runs(shape: tuple, index: tuple, itemsize: int) -> bool:
    """Whether `index` (a tuple of step-1 slices) of a C-ordered array of
    `shape` is many short runs of the file (a weight split by columns),
    which are best read by blocks of whole rows.

    Example:
    >>> has_short_runs((4096, 4096), (slice(None), slice(0, 512)), 2)
    True
    """
    _, outer, run = _runs(shape, index)
    return _short_runs(outer, run, itemsize)


class ReadBySlices:
    """`ndim`, `read` and `np.asarray` for a lazy tensor with a `shape` and
    a `read_slices(indices)`."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, index: tuple | None = None) -> np.ndarray:
        """Read `index` (a tuple of slices; `None`: all) of the tensor."""
        index = tuple(slice(None) for _ in self.shape) if index is None else index
        return self.read_slices([index])[0]

    def __array__(self, dtype=None, copy=None):
        values = self.read()
        return values if dtype is None else values.astype(dtype)


class ContiguousTensor:
    """A C-ordered tensor stored contiguously in a file, from `offset` on.

    Args:
        file: the `HeldFile` holding it.
        offset: the byte offset of its first element.
        shape: its shape.
        dtype: its numpy dtype (little-endian, as stored).

    Example:
    ```python
    tensor = ContiguousTensor(file, offset=128, shape=(4, 8), dtype="float32")
    top, bottom = tensor.read_slices([(slice(0, 2), slice(None)),
                                      (slice(2, 4), slice(None))])
    ```
    """

    def __init__(self, file: HeldFile, offset: int, shape, dtype):
        self.file = file
        self.offset = int(offset)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)

    def read_slices(
        self, indices: list, executor=None, dtype=None, outputs=None
    ) -> list[np.ndarray]:
        """Read each index of `indices` (tuples of step-1 slices).

        Slices whose contiguous runs are long are read run by run straight
        into their buffers; slices of many short runs (a weight split by
        columns) are read together by blocks of whole rows, each byte of
        the file once, and copied into their buffers.

        Args:
            indices: tuples of slices, one per dimension.
            executor: a `concurrent.futures.Executor` to read on, or `None`
                to read in the calling thread.
            dtype: the dtype of the returned arrays, cast from the file's
                as each piece is read (`None`: the file's).
            outputs: C-contiguous arrays to read into, one per index, of
                its shape and `dtype` (`None`: fresh aligned ones).

        Returns:
            One array per index: `outputs`, or fresh aligned arrays.
        """
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        indices = [self._normalize(index) for index in indices]
        if outputs is None:
            # Unpopulated: each task faults in the part it fills.
            outputs = [
                aligned_empty(local_shape(index, self.shape), dtype, zeros=True)
                for index in indices
            ]
        else:
            outputs = list(outputs)
            _check_outputs(indices, self.shape, dtype, outputs)
        tasks, gathered = [], []
        for index, output in zip(indices, outputs):
            if output.size == 0:
                continue
            first, outer, run = _runs(self.shape, index)
            if _short_runs(outer, run, self.dtype.itemsize):
                gathered.append((index, output))
            else:
                tasks += self._direct_tasks(first, outer, run, output)
        if gathered:
            tasks += self._gather_tasks(gathered)
        run_tasks(tasks, executor)
        return outputs

    def read(self, index: tuple | None = None, executor=None) -> np.ndarray:
        """Read `index` (a tuple of slices; `None`: the whole tensor)."""
        index = tuple(slice(None) for _ in self.shape) if index is None else index
        return self.read_slices([index], executor)[0]

    def _normalize(self, index: tuple) -> tuple:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        normalized = []
        for s, n in zip(index, self.shape):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(
                    f"Only slices of step 1 are read from weight files. "
                    f"Received: index={index!r}"
                )
            normalized.append(slice(start, max(start, stop)))
        return tuple(normalized)

    def _direct_tasks(self, first, outer, run, output) -> list:
        """Tasks of about `READ_CHUNK_BYTES` of the file each, reading runs
        of `run` elements (from element `first` + each of `outer`) into
        consecutive parts of `output`."""
        chunk = max(1, READ_CHUNK_BYTES // self.dtype.itemsize)
        pieces = []  # (file element, output element, elements)
        for number, start in enumerate(outer.tolist()):
            for done in range(0, run, chunk):
                size = min(chunk, run - done)
                pieces.append((first + start + done, number * run + done, size))
        tasks, group, grouped = [], [], 0
        for piece in pieces:
            group.append(piece)
            grouped += piece[2]
            if grouped >= chunk:
                tasks.append(self._read_pieces_task(group, output))
                group, grouped = [], 0
        if group:
            tasks.append(self._read_pieces_task(group, output))
        return tasks

    def _read_pieces_task(self, pieces, output):
        flat = output.reshape(-1)
        itemsize = output.dtype.itemsize
        cast = output.dtype != self.dtype

        def read():
            low = min(piece[1] for piece in pieces)
            high = max(piece[1] + piece[2] for piece in pieces)
            populate(flat, low * itemsize, high * itemsize)
            # A cast reads into one scratch buffer of the file's dtype.
            largest = max(piece[2] for piece in pieces)
            scratch = np.empty(largest, self.dtype) if cast else None
            for file_element, output_element, size in pieces:
                target = flat[output_element : output_element + size]
                buffer = scratch[:size] if cast else target
                self.file.read_into(
                    _raw(buffer), self.offset + file_element * self.dtype.itemsize
                )
                if cast:
                    convert(buffer, target)

        return read

    def _gather_tasks(self, gathered) -> list:
        """Blocks of rows covering every gathered slice, each read once and
        copied into the part of each slice it holds."""
        shape, itemsize = self.shape, self.dtype.itemsize
        row = math.prod(shape[1:])
        strides = [math.prod(shape[axis + 1 :]) for axis in range(1, len(shape))]
        low = min(index[0].start for index, _ in gathered)
        high = max(index[0].stop for index, _ in gathered)
        # The part of a row any gathered slice needs, in elements.
        begin = min(
            sum(s.start * k for s, k in zip(index[1:], strides))
            for index, _ in gathered
        )
        end = max(
            sum((s.stop - 1) * k for s, k in zip(index[1:], strides)) + 1
            for index, _ in gathered
        )
        whole_rows = (begin, end) == (0, row)
        rows_per_block = max(1, READ_CHUNK_BYTES // max(1, (end - begin) * itemsize))

        def block_task(first_row, last_row):
            def read():
                count = last_row - first_row
                block = np.empty((count, row), self.dtype)
                if whole_rows:
                    self.file.read_into(
                        _raw(block), self.offset + first_row * row * itemsize
                    )
                else:
                    for number in range(count):
                        self.file.read_into(
                            _raw(block[number, begin:end]),
                            self.offset
                            + ((first_row + number) * row + begin) * itemsize,
                        )
                block = block.reshape((count,) + shape[1:])
                for index, output in gathered:
                    top = max(index[0].start, first_row)
                    bottom = min(index[0].stop, last_row)
                    if top >= bottom:
                        continue
                    part = output[top - index[0].start : bottom - index[0].start]
                    offset = part.ctypes.data - output.ctypes.data
                    populate(output, offset, offset + part.nbytes)
                    convert(
                        block[
                            (slice(top - first_row, bottom - first_row),) + index[1:]
                        ],
                        part,
                    )

            return read

        return [
            block_task(start, min(start + rows_per_block, high))
            for start in range(low, high, rows_per_block)
        ]

    def __array__(self, dtype=None, copy=None):
        values = self.read()
        return values if dtype is None else values.astype(dtype)
