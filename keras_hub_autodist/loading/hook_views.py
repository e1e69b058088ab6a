"""A converter's hook, applied slice by slice when it only moves axes.

keras-hub's Hugging Face converters hand most tensors to `port_weight` with
a hook that reshapes and transposes them into Keras' layout, e.g. a
query projection `(heads * head_dim, hidden)` into `(heads, hidden,
head_dim)`. Applied to the whole tensor, such a hook needs the whole tensor
read into fresh host memory before each device's slice is copied out of
it. A hook that only reshapes and transposes moves elements without
changing them, so each slice of its result is a box of the file's tensor,
reshaped and transposed.

`trace_hook` runs the hook on a `TracedTensor`, which has a shape and no
values and records what is done to it; anything but a reshape or a
transpose makes the trace fail, and the hook then runs on the values as
keras-hub runs it. `HookView` is the traced hook's result: a lazy tensor
whose slices are each read from the box of the file they come from, then
reshaped and transposed, in the reading thread, through a buffer reused by
that thread.

Example:
```python
view = HookView(lazy_tensor, trace_hook(hook_fn, lazy_tensor, keras_shape))
top = view.read((slice(0, 2), slice(None), slice(None)))
```
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from keras_hub_autodist.loading.file_reads import ReadBySlices
from keras_hub_autodist.loading.file_reads import aligned_empty
from keras_hub_autodist.loading.file_reads import convert
from keras_hub_autodist.loading.file_reads import has_short_runs
from keras_hub_autodist.loading.file_reads import local_shape
from keras_hub_autodist.loading.file_reads import populate
from keras_hub_autodist.loading.file_reads import run_tasks

# An operation of a traced hook: ("reshape", new shape) or ("transpose", axes).
RESHAPE = "reshape"
TRANSPOSE = "transpose"


class TracedTensor:
    """A tensor's shape and dtype, and the reshapes and transposes applied
    to it so far (`ops`). It holds no values: asking for them, or any other
    operation, raises `TypeError`.

    Args:
        shape: the shape.
        dtype: the dtype.
        ops: the operations that made it from the traced tensor.
    """

    # numpy's ufuncs and Python's operators refuse it.
    __array_ufunc__ = None

    def __init__(self, shape, dtype, ops: tuple = ()):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.ops = ops

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape, order="C") -> TracedTensor:
        if order != "C":
            raise TypeError(f"Only C-order reshapes are traced. Received: {order!r}")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        shape = [int(n) for n in shape]
        size = math.prod(self.shape)
        if shape.count(-1) == 1:
            known = math.prod(n for n in shape if n != -1)
            shape[shape.index(-1)] = size // known if known else 0
        if math.prod(shape) != size or min(shape, default=0) < 0:
            raise ValueError(
                f"cannot reshape a tensor of shape {self.shape} into {tuple(shape)}"
            )
        return TracedTensor(shape, self.dtype, self.ops + ((RESHAPE, tuple(shape)),))

    def transpose(self, *axes) -> TracedTensor:
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = axes[0]
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        axes = tuple(int(a) % self.ndim if self.ndim else int(a) for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} don't match a tensor of shape {self.shape}")
        shape = tuple(self.shape[a] for a in axes)
        return TracedTensor(shape, self.dtype, self.ops + ((TRANSPOSE, axes),))

    @property
    def T(self) -> TracedTensor:
        return self.transpose()

    def __array__(self, *args, **kwargs):
        raise TypeError("A traced tensor has no values.")

    def __array_function__(self, func, types, args, kwargs):
        traced = _TRACED_FUNCTIONS.get(func)
        return NotImplemented if traced is None else traced(*args, **kwargs)


def _reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    if copy is not None and not isinstance(a, TracedTensor):
        return NotImplemented
    return a.reshape(newshape if shape is None else shape, order=order)


def _transpose(a, axes=None):
    return a.transpose(axes)


# The numpy functions a traced hook may call, as the methods they stand for.
_TRACED_FUNCTIONS = {np.reshape: _reshape, np.transpose: _transpose}


def trace_hook(hook_fn, tensor, keras_shape) -> tuple | None:
    """The reshapes and transposes `hook_fn` applies to a tensor of
    `tensor`'s shape and dtype to give `keras_shape`, or `None` when it does
    anything else (it then needs the values)."""
    traced = TracedTensor(tensor.shape, tensor.dtype)
    try:
        result = hook_fn(traced, list(keras_shape))
    except Exception:
        return None
    if not isinstance(result, TracedTensor):
        return None
    if result.shape != tuple(keras_shape):
        return None
    return result.ops


def apply_hook(hook_fn, tensor, keras_shape):
    """`hook_fn(tensor, keras_shape)`: a `HookView` of `tensor` when it is
    a lazy tensor and the hook only reshapes and transposes it, else the
    hook applied to the tensor's values."""
    if hasattr(tensor, "read_slices"):
        ops = trace_hook(hook_fn, tensor, keras_shape)
        if ops is not None:
            return HookView(tensor, ops)
        tensor = tensor.read()
    return hook_fn(tensor, keras_shape)


def _groups(before: tuple, after: tuple) -> list[tuple[range, range]] | None:
    """The axes of a C-order reshape from `before` to `after`, in groups
    whose sizes multiply to the same number: (axes before, axes after)."""
    groups, i, j = [], 0, 0
    while i < len(before) or j < len(after):
        start_i, start_j = i, j
        size_i = size_j = 1
        if i < len(before):
            size_i, i = before[i], i + 1
        if j < len(after):
            size_j, j = after[j], j + 1
        while size_i != size_j:
            if size_i < size_j and i < len(before):
                size_i, i = size_i * before[i], i + 1
            elif size_j < size_i and j < len(after):
                size_j, j = size_j * after[j], j + 1
            else:
                return None
        # Trailing axes of size 1 belong to the group they follow.
        while i < len(before) and before[i] == 1 and j == len(after):
            i += 1
        while j < len(after) and after[j] == 1 and i == len(before):
            j += 1
        groups.append((range(start_i, i), range(start_j, j)))
    return groups


def _flat_range(box: list[tuple[int, int]], shape: list[int]) -> tuple | None:
    """The C-order flat range `[first, stop)` of `box` of an array of
    `shape`, when the box is one such range: axes of one index, then a
    range, then whole axes."""
    axis = 0
    while axis < len(shape) and box[axis][1] - box[axis][0] == 1:
        axis += 1
    if any(box[a] != (0, shape[a]) for a in range(axis + 1, len(shape))):
        return None
    first = stop = 0
    for a, n in enumerate(shape):
        first = first * n + box[a][0]
        stop = stop * n + (box[a][1] - 1)
    return first, stop + 1


def _box_of(first: int, stop: int, shape: list[int]) -> list[tuple[int, int]] | None:
    """The box of an array of `shape` whose C-order flat range is
    `[first, stop)`, if it is one."""
    if not shape:
        return [] if (first, stop) == (0, 1) else None
    inners = [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]
    for axis, (n, inner) in enumerate(zip(shape, inners)):
        block = inner * n
        if first % inner or stop % inner or first // block != (stop - 1) // block:
            continue
        box = [((first // k) % m, (first // k) % m + 1) for m, k in zip(shape, inners)]
        box[axis] = ((first // inner) % n, ((stop - 1) // inner) % n + 1)
        box[axis + 1 :] = [(0, m) for m in shape[axis + 1 :]]
        return box
    return None


def _stage_boxes(ops: tuple, shapes: list[tuple], box: list) -> list | None:
    """The box at every stage of the hook (`shapes[k]`: the shape before
    operation `k`, then the result's) that `box` of its result comes from,
    the source tensor's first; `None` when a reshape makes one of them more
    than one box."""
    boxes = [box]
    for (kind, argument), before in zip(reversed(ops), reversed(shapes[:-1])):
        if kind == TRANSPOSE:
            source = [None] * len(box)
            for position, axis in enumerate(argument):
                source[axis] = box[position]
        else:
            groups = _groups(before, argument)
            if groups is None:
                return None
            source = [None] * len(before)
            for axes_before, axes_after in groups:
                part = _flat_range(
                    [box[a] for a in axes_after], [argument[a] for a in axes_after]
                )
                if part is None:
                    return None
                mapped = _box_of(*part, [before[a] for a in axes_before])
                if mapped is None:
                    return None
                for axis, bounds in zip(axes_before, mapped):
                    source[axis] = bounds
        box = source
        boxes.append(box)
    return boxes[::-1]


_scratch = threading.local()
# A thread keeps its scratch buffer for the next slice up to this size;
# a larger one is freed once used, so that no thread holds a large buffer
# idle until the load ends.
KEPT_SCRATCH_BYTES = 64 * 1024**2


def _thread_scratch(shape, dtype) -> np.ndarray:
    """A C-contiguous array of `shape`, over a buffer this thread reuses for
    every slice it reads (fresh memory is dear to fault in)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = aligned_empty((nbytes,), np.uint8)
        _scratch.buffer = buffer if nbytes <= KEPT_SCRATCH_BYTES else None
    return buffer[:nbytes].view(dtype).reshape(shape)


def release_scratch() -> None:
    """Free this thread's scratch buffer."""
    _scratch.buffer = None


class HookView(ReadBySlices):
    """A converter hook's result, read slice by slice from the file's tensor.

    Args:
        source: the lazy tensor of the file (`LazySafetensor`).
        ops: the hook's reshapes and transposes (`trace_hook`).
    """

    def __init__(self, source, ops: tuple):
        self.source = source
        self.ops = ops
        shapes = [tuple(source.shape)]
        for kind, argument in ops:
            if kind == RESHAPE:
                shapes.append(tuple(argument))
            else:
                shapes.append(tuple(shapes[-1][a] for a in argument))
        self._shapes = shapes
        self.shape = shapes[-1]
        self.dtype = np.dtype(source.dtype)

    def _apply(self, values: np.ndarray, boxes: list) -> np.ndarray:
        """`values` (the source's `boxes[0]`) through the hook's operations,
        `boxes` holding what each stage holds (`_stage_boxes`)."""
        for (kind, argument), box in zip(self.ops, boxes[1:]):
            if kind == TRANSPOSE:
                values = np.transpose(values, argument)
            else:
                values = np.reshape(values, [high - low for low, high in box])
        return values

    def read_slices(
        self, indices: list, executor=None, dtype=None, outputs=None
    ) -> list[np.ndarray]:
        """Read each index of `indices` (tuples of step-1 slices), cast to
        `dtype` (`None`: the file's), into `outputs` when given (C-contiguous
        arrays of each slice's shape and `dtype`)."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        boxes = [
            [s.indices(n)[:2] for s, n in zip(_full(index, self.ndim), self.shape)]
            for index in indices
        ]
        stages = [_stage_boxes(self.ops, self._shapes, box) for box in boxes]
        if outputs is None:
            outputs = [
                aligned_empty(local_shape(_full(i, self.ndim), self.shape), dtype)
                for i in indices
            ]
        if any(stage is None for stage in stages):
            # Not one box of the file: the whole tensor, as keras-hub reads it.
            whole_boxes = [[(0, n) for n in shape] for shape in self._shapes]
            whole = self._apply(np.asarray(self.source.read()), whole_boxes)
            for box, output in zip(boxes, outputs):
                convert(whole[_slices(box)], output)
            return outputs
        if any(
            has_short_runs(self._shapes[0], _slices(stage[0]), self.dtype.itemsize)
            for stage in stages
        ):
            tasks = self._tasks_from_one_read(stages, outputs, executor)
        else:
            tasks = [
                functools.partial(self._read_into, stage, output)
                for stage, output in zip(stages, outputs)
                if output.size
            ]
        if executor is None:
            # The calling thread keeps no scratch buffer past this read.
            try:
                run_tasks(tasks, None)
            finally:
                release_scratch()
        elif len(tasks) == 1:
            executor.submit(tasks[0]).result()
        else:
            run_tasks(tasks, executor)
        return outputs

    def _read_into(self, stages: list, output: np.ndarray) -> None:
        """Read the slice's box of the file (`stages[0]`) into this thread's
        scratch buffer, and its result into `output`."""
        shape = tuple(high - low for low, high in stages[0])
        scratch = _thread_scratch(shape, self.dtype)
        self.source.read_slices([_slices(stages[0])], None, outputs=[scratch])
        populate(output, 0, output.nbytes)
        convert(self._apply(scratch, stages), output)

    def _tasks_from_one_read(self, stages: list, outputs: list, executor) -> list:
        """Read the box bounding every slice's box of the file (split by
        columns: whole rows) into the calling thread's scratch buffer, on
        `executor`; return the tasks that move each slice's part into its
        output."""
        sources = [stage[0] for stage in stages]
        bounds = [
            (min(box[a][0] for box in sources), max(box[a][1] for box in sources))
            for a in range(len(self._shapes[0]))
        ]
        shape = tuple(high - low for low, high in bounds)
        scratch = _thread_scratch(shape, self.dtype)
        self.source.read_slices([_slices(bounds)], executor, outputs=[scratch])

        def move(stage, output):
            part = scratch[
                tuple(
                    slice(low - base, high - base)
                    for (low, high), (base, _) in zip(stage[0], bounds)
                )
            ]
            populate(output, 0, output.nbytes)
            convert(self._apply(part, stage), output)

        return [
            functools.partial(move, stage, output)
            for stage, output in zip(stages, outputs)
            if output.size
        ]

    def __repr__(self):
        return f"<HookView of {self.source!r} shape={self.shape}>"


def _slices(box: list) -> tuple:
    return tuple(slice(low, high) for low, high in box)


def _full(index: tuple, ndim: int) -> tuple:
    return tuple(index) + (slice(None),) * (ndim - len(index))
