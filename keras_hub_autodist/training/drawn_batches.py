"""Batches checked against the mesh: before a loop starts, and as drawn.

A batch must split over the batch axis (rows) and, on a context mesh, its
sequences over the context axis (dimension 1). What is known before a
bound method's loop starts (arrays, a dataset's declared shapes, a task's
preprocessing length) is checked then, before Keras takes the model's
variables for its loop. What is known only when drawn (a dataset of unknown
batch size, a ragged last batch, a generator) is checked as each batch is
placed on the mesh, before it reaches a step, with the same errors.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.errors import BatchSizeError
from keras_hub_autodist.planning.distribution import ContextParallel
from keras_hub_autodist.training.batch_placement import place

# (distribution, method) of the bound method feeding batches in this thread.
_FEEDING = contextvars.ContextVar("keras_hub_autodist_feeding", default=None)


def _batch_axis_size(distribution) -> int:
    mesh = distribution.device_mesh
    return mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)]


def check_drawn_rows(distribution, method: str, shape) -> None:
    """Raise `BatchSizeError` when a drawn batch of `shape` (process-local)
    won't split over the batch axis.

    Example:
    ```python
    check_drawn_rows(distribution, "fit", (2, 8))  # batch axis of 4: raises
    ```
    """
    if not shape:
        return
    axis_size = _batch_axis_size(distribution)
    processes = distribution.num_processes
    rows = int(shape[0])
    if (rows * processes) % axis_size == 0:
        return
    per_process = f" per process ({rows * processes} in all)" if processes > 1 else ""
    raise BatchSizeError(
        f"A batch drawn from the data has {rows} rows{per_process}, which does "
        f"not divide by the batch axis '{distribution.batch_dim_name}' of size "
        f"{axis_size}. Use a batch size that is a multiple of {axis_size}, and "
        "drop the remainder of a dataset whose size it doesn't divide "
        "(`.batch(n, drop_remainder=True)`). Received: "
        f"{method}() drew a batch of shape {tuple(shape)}"
    )


def check_sequence(distribution, method: str, shape) -> None:
    """Raise `SequenceLengthError` when a batch tensor of `shape` has a
    sequence length (dimension 1) the context axis doesn't divide; nothing
    off a context mesh, while decoding, or for tensors of rank < 2."""
    if not isinstance(distribution, ContextParallel) or len(shape) < 2:
        return
    length = shape[1]
    if length is None or int(length) % distribution.context_size == 0:
        return
    # Raises `SequenceLengthError` naming the shape, unless decoding (whose
    # sequences are not split).
    distribution.get_data_layout(tuple(shape))


def _checked_distribute(distribute):
    @functools.wraps(distribute)
    def call(per_process_batch, layout, *args, **kwargs):
        feeding = _FEEDING.get()
        shape = getattr(per_process_batch, "shape", None)
        if feeding is not None and shape is not None:
            distribution, method = feeding
            check_drawn_rows(distribution, method, shape)
            check_sequence(distribution, method, shape)
        if feeding is None:
            return distribute(per_process_batch, layout, *args, **kwargs)
        return place(
            per_process_batch,
            layout,
            lambda batch, layout: distribute(batch, layout, *args, **kwargs),
        )

    return call


@contextlib.contextmanager
def checking_drawn_batches(distribution, method: str) -> Iterator[None]:
    """Check every batch a Keras loop in this thread places on the mesh
    (`check_drawn_rows`, `check_sequence`) for the block's duration."""
    token = _FEEDING.set((distribution, method))
    try:
        with compat.patched({"checked_batches": _checked_distribute}):
            yield
    finally:
        _FEEDING.reset(token)


def _leaf_shapes(data) -> list:
    """The shapes of the arrays (or a dataset's declared tensors) in `data`."""
    spec = getattr(data, "element_spec", None)
    leaves = keras.tree.flatten(spec if spec is not None else data)
    shapes = []
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        # A `tf.TensorShape` of unknown rank has no dimensions to check.
        if getattr(shape, "rank", 0) is None:
            continue
        shapes.append(tuple(shape))
    return shapes


def _is_text(data) -> bool:
    leaves = keras.tree.flatten(getattr(data, "element_spec", data))
    for leaf in leaves:
        if isinstance(leaf, str):
            return True
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and str(getattr(dtype, "name", dtype)) in (
            "string",
            "object",
        ):
            return True
        if dtype is not None and getattr(dtype, "kind", "") in ("U", "S", "O"):
            return True
    return False


# The methods whose second positional argument is `y`.
_LABELED = ("fit", "evaluate", "train_on_batch", "test_on_batch")


def check_sequences_first(distribution, model, method: str, args, kwargs) -> None:
    """Refuse, before a bound method's loop starts, inputs whose sequence
    length the context axis doesn't divide: arrays, a dataset's declared
    shapes, validation data, and text that the task's preprocessor packs to
    its `sequence_length`. Nothing off a context mesh."""
    if not isinstance(distribution, ContextParallel):
        return
    feeds = list(args[:1]) + [kwargs.get("x")]
    if method in _LABELED:
        feeds += list(args[1:2]) + [kwargs.get("y"), kwargs.get("sample_weight")]
    validation = kwargs.get("validation_data") if method == "fit" else None
    if validation is not None:
        feeds.append(validation)
    preprocessor = getattr(model, "preprocessor", None)
    length = getattr(preprocessor, "sequence_length", None)
    for data in feeds:
        if data is None:
            continue
        if isinstance(length, int) and _is_text(data):
            check_sequence(distribution, method, (None, length))
        for shape in _leaf_shapes(data):
            check_sequence(distribution, method, shape)
