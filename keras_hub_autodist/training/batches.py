"""Batches that divide the mesh's batch axis: checks, padding, unpadding.

A sharded batch must split evenly over the batch axis of the mesh (times the
number of processes). `check_batch` refuses a batch that won't, before
anything runs; `pad_batch` pads a batch with zero-weight rows, marked so
that a bound task's steps count only its real rows (`padded_steps`);
`predict_unpadded` and `generate_padded` drop the padded rows from what the
user gets back.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import weakref

import keras
import numpy as np

from keras_hub_autodist.errors import BatchSizeError
from keras_hub_autodist.errors import PaddingWarning
from keras_hub_autodist.errors import warn
from keras_hub_autodist.training.padded_steps import marked
from keras_hub_autodist.words import counted

# Keras' default batch size for arrays passed without `batch_size`.
KERAS_DEFAULT_BATCH_SIZE = 32


def sample_count(x) -> int | None:
    """Number of samples in `x` (arrays, dicts of arrays, strings), or None."""
    if isinstance(x, str):
        return 1
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, str) for s in x):
        return len(x)
    for leaf in keras.tree.flatten(x):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return shape[0]
    return None


def _dataset_batch(x):
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return None
    for leaf in keras.tree.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return shape[0]
    return None


def _requested_batch_size(method: str, args, kwargs) -> int:
    """The `batch_size` a `fit`, `evaluate` or `predict` call on arrays was
    given, by keyword or position, or Keras' default."""
    batch_size = kwargs.get("batch_size")
    if batch_size is None:
        positional = {"fit": 2, "evaluate": 2, "predict": 1}
        index = positional.get(method)
        if index is not None and len(args) > index and args[index] is not None:
            batch_size = args[index]
    return batch_size or KERAS_DEFAULT_BATCH_SIZE


def requested_rows(method: str, args, kwargs) -> int | None:
    """The rows of the first batch a `fit` (or `evaluate`) call feeds in
    this process, as its caller batched them (before any padding): a
    dataset's batch size, or `batch_size` capped at the number of samples;
    None when unknown.

    Example:
    >>> requested_rows("fit", (np.ones((8, 3)),), {"batch_size": 2})
    2
    """
    x = args[0] if args else kwargs.get("x")
    if x is None:
        return None
    batch = _dataset_batch(x)
    if batch is not None or hasattr(x, "element_spec"):
        return batch
    count = sample_count(x)
    if count is None:
        return None
    return min(_requested_batch_size(method, args, kwargs), int(count))


# The rows per batch of the bound model's `fit` running in this thread or
# task, as its caller batched them (`feeding_rows`).
_FED_ROWS = contextvars.ContextVar("keras_hub_autodist_fed_rows", default=None)


@contextlib.contextmanager
def feeding_rows(rows: int | None):
    """A scope in which `fed_rows()` answers `rows` (a bound `fit`)."""
    token = _FED_ROWS.set(rows)
    try:
        yield
    finally:
        _FED_ROWS.reset(token)


def fed_rows() -> int | None:
    """The rows of the first batch, in this process, of the bound model's
    `fit` running in this thread, as its caller batched them: a bound task
    pads batches that don't divide the batch axis, so its train step sees
    more. None outside such a `fit`, or when unknown."""
    return _FED_ROWS.get()


def _batch_axis_size(distribution) -> int:
    mesh = distribution.device_mesh
    return mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)]


def rows_multiple(distribution) -> int:
    """Rows a process-local batch must be a multiple of.

    The global batch (local rows × processes) must divide the batch axis.
    """
    axis_size = _batch_axis_size(distribution)
    return axis_size // math.gcd(axis_size, distribution.num_processes)


def _is_tf(leaf) -> bool:
    return type(leaf).__module__.startswith("tensorflow")


def pad_batch(data, multiple: int):
    """Pad a batch up to a multiple of `multiple` rows, marking its real rows.

    Extra rows repeat the last row (any dtype, strings included). A batch
    with labels gets a marked sample weight (`padded_steps.marked`): the
    caller's weights (ones when none) with 0 on padded rows, and which rows
    are real, from which a bound task's steps count the batch as its real
    rows alone (`padded_steps`). Works on NumPy (and JAX) arrays and inside
    a `tf.data` map.

    Args:
        data: `x`, or `(x, y)` / `(x, y, sample_weight)` as keras packs them.
        multiple: the rows of the result are a multiple of it.

    Example:
    ```python
    x, y, w = pad_batch((np.ones((2, 3)), np.ones((2,))), 4)
    # x.shape == (4, 3); unmarked(w) == ([1., 1., 0., 0.], [1., 1., 0., 0.])
    ```
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    first = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None)
    if any(_is_tf(leaf) for leaf in keras.tree.flatten(data) if leaf is not None):
        import tensorflow as tf

        count = tf.shape(first)[0]
        target = (count + multiple - 1) // multiple * multiple
        index = tf.minimum(tf.range(target), count - 1)
        real = tf.range(target) < count

        def take(leaf):
            return tf.gather(leaf, index)

        def weights(rows):
            rows = tf.cast(rows, "float32")
            # Rows of any rank, known when traced or not.
            trailing = tf.ones([tf.rank(rows) - 1], "int32")
            mask = tf.reshape(real, tf.concat([[-1], trailing], 0))
            return tf.where(mask, rows, 0.0)

        def ones(label):
            shape = tf.shape(label)
            if not label.dtype.is_integer and (label.shape.rank or 0) > 1:
                shape = shape[:-1]
            return tf.ones(shape)

        real_rows = tf.cast(real, "float32")
    else:
        count = int(first.shape[0])
        target = -(-count // multiple) * multiple
        index = np.minimum(np.arange(target), count - 1)
        real = np.arange(target) < count

        def take(leaf):
            return np.take(np.asarray(leaf), index, axis=0)

        def weights(rows):
            rows = np.asarray(rows, dtype="float32")
            mask = real.reshape((-1,) + (1,) * (rows.ndim - 1))
            return np.where(mask, rows, 0.0).astype("float32")

        def ones(label):
            shape = np.shape(label)
            if not np.issubdtype(np.asarray(label).dtype, np.integer):
                shape = shape[:1] + shape[1:-1]
            return np.ones(shape, dtype="float32")

        real_rows = real.astype("float32")

    def pad(structure):
        return keras.tree.map_structure(
            lambda leaf: None if leaf is None else take(leaf), structure
        )

    if y is None:
        return pad(x) if sample_weight is None else (pad(x), None, take(sample_weight))
    if sample_weight is None:
        # One weight per loss value: per token for sparse labels such as
        # (batch, sequence) ids, per row for (batch, classes) targets. A
        # (batch,) weight against (batch, sequence) losses would be broadcast
        # over the sequence axis by keras.
        sample_weight = ones(keras.tree.flatten(y)[0])
    padded_weights = keras.tree.map_structure(weights, pad(sample_weight))
    return pad(x), pad(y), marked(padded_weights, real_rows)


def _batch_sizes(x, batch_size, steps=None):
    """Rows of each batch `predict` makes of `x`, or None if unknown."""
    if hasattr(x, "element_spec") and hasattr(x, "map"):
        import tensorflow as tf

        def rows(*element):
            return tf.shape(tf.nest.flatten(element)[0])[0]

        x = x if steps is None else x.take(steps)
        return [int(n) for n in x.map(rows)]
    count = sample_count(x)
    if count is None:
        return None
    batch_size = batch_size or KERAS_DEFAULT_BATCH_SIZE
    return [min(batch_size, count - start) for start in range(0, count, batch_size)]


def _real_rows(sizes, multiple):
    """Indices of the real rows among batches of `sizes` padded to `multiple`."""
    keep, start = [], 0
    for size in sizes:
        keep.append(np.arange(start, start + size))
        start += -(-size // multiple) * multiple
    return np.concatenate(keep) if keep else np.zeros((0,), dtype=int)


def predict_unpadded(predict, multiple, x=None, batch_size=None, **kwargs):
    """`predict` of a model whose batches are padded; padded rows dropped."""
    sizes = _batch_sizes(x, batch_size, kwargs.get("steps"))
    outputs = predict(x, batch_size=batch_size, **kwargs)
    if not sizes or all(size % multiple == 0 for size in sizes):
        return outputs
    keep = _real_rows(sizes, multiple)
    return keras.tree.map_structure(lambda leaf: np.asarray(leaf)[keep], outputs)


# Per model, the methods whose padding was already said.
_PADDING_SAID = weakref.WeakKeyDictionary()


def warn_padding(model, method: str, rows: int | None, multiple: int) -> None:
    """Warn, once per model and method, that batches of `rows` rows are
    padded to a multiple of `multiple` (nothing when they divide, or when
    `rows` is unknown).

    Example:
    >>> import warnings
    >>> class Model: pass
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_padding(Model(), "fit", 3, 4)
    >>> "batches of 3 rows are padded to 4" in str(caught[0].message)
    True
    """
    if rows is None or multiple <= 1 or rows % multiple == 0:
        return
    said = _PADDING_SAID.setdefault(model, set())
    if method in said:
        return
    said.add(method)
    target = -(-rows // multiple) * multiple
    if method == "generate":
        what = (
            f"generate: {counted(rows, 'prompt')} {'is' if rows == 1 else 'are'} "
            f"padded to {target} "
            "(a multiple of "
            f"the {multiple} devices of the batch axis); the extra outputs "
            "are dropped."
        )
    else:
        what = (
            f"{method}: batches of {counted(rows, 'row')} are padded to "
            f"{target} rows (a "
            f"multiple of the {multiple} devices of the batch axis) with "
            "zero-weight rows: results are those of the real rows, but the "
            "padded ones cost compute."
        )
    warn(
        f"{what} A batch size that is a multiple of {multiple} avoids it.",
        PaddingWarning,
    )


def padding_preprocess(preprocess_samples, multiple: int):
    """Wrap a task's `preprocess_samples` so that it pads every batch.

    Args:
        preprocess_samples: the task's own `preprocess_samples` method.
        multiple: the rows of each batch are padded to a multiple of it.
    """

    @functools.wraps(preprocess_samples)
    def call(x, y=None, sample_weight=None):
        return pad_batch(preprocess_samples(x, y, sample_weight), multiple)

    call.__keras_hub_autodist_scoped__ = True  # binding._WRAPPED_ATTR
    return call


def on_padded_batch(model, method: str, x, y=None, sample_weight=None, **kwargs):
    """`train_on_batch`/`test_on_batch` (`method`) of a task that pads its
    batches: keras-hub's own method, whose conversion of the sample weight
    to one tensor would break the mark of the real rows, is replaced by
    what it does: preprocess (and pad) the batch, then Keras' method.
    """

    def tensors(structure):
        if structure is None:
            return None
        return keras.tree.map_structure(keras.ops.convert_to_tensor, structure)

    data = model.preprocess_samples(x, y, sample_weight)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    run = getattr(keras.Model, method)
    weights = tensors(sample_weight)
    return run(model, x=tensors(x), y=tensors(y), sample_weight=weights, **kwargs)


def check_batch(distribution, method: str, args, kwargs) -> None:
    """Raise `BatchSizeError` when a batch won't split over the batch axis.

    Checked before anything runs, for arrays and batched `tf.data` datasets.
    In a multi-process run, each process passes its process-local batch; the
    global batch (local × number of processes) must divide.
    """
    axis = distribution.batch_dim_name
    axis_size = _batch_axis_size(distribution)
    processes = distribution.num_processes
    if axis_size == 1:
        return
    x = args[0] if args else kwargs.get("x")
    validation = kwargs.get("validation_data") if method == "fit" else None
    if validation is not None:
        vx = validation
        if isinstance(validation, (tuple, list)) and not hasattr(vx, "element_spec"):
            vx = validation[0]
        size = kwargs.get("validation_batch_size") or kwargs.get("batch_size")
        check_batch(
            distribution, "fit(validation_data=...)", (vx,), {"batch_size": size}
        )
    if x is None:
        return

    def fail(batch, what):
        per_process = (
            f" per process ({batch * processes} in all)" if processes > 1 else ""
        )
        raise BatchSizeError(
            f"{what}: {batch}{per_process} does not divide by the batch axis "
            f"'{axis}' of size {axis_size}. Use a batch size that is a "
            f"multiple of {axis_size}, or drop the remainder. Received: "
            f"{method if '(' in method else method + '()'} with batch size {batch}"
        )

    batch = _dataset_batch(x)
    if batch is not None:
        if (batch * processes) % axis_size:
            fail(batch, "The dataset's batch size")
        return
    count = sample_count(x)
    if count is None:
        return
    if method.endswith("_on_batch"):
        if (count * processes) % axis_size:
            fail(count, "The batch size")
        return
    if method == "generate":
        return
    batch_size = _requested_batch_size(method, args, kwargs)
    full = min(batch_size, count)
    if (full * processes) % axis_size:
        fail(full, "The batch size")
    remainder = count % batch_size if count > batch_size else 0
    if (remainder * processes) % axis_size:
        fail(
            remainder,
            f"The last batch of {count} samples in batches of {batch_size}",
        )


def _pad_rows(data, count, target):
    def pad(leaf):
        leaf = np.asarray(leaf)
        extra = np.repeat(leaf[-1:], target - count, axis=0)
        return np.concatenate([leaf, extra], axis=0)

    return keras.tree.map_structure(pad, data)


def generate_padded(generate, distribution, inputs, *args, **kwargs):
    """Run `generate` on a batch padded to a multiple of the batch axis.

    keras-hub shards `generate` inputs on the batch axis, so a single prompt
    on a mesh whose batch axis has 2 devices fails with `IndivisibleError`.
    Prompts are repeated up to the next multiple and the extra outputs
    dropped: the caller gets exactly one output per prompt.
    """
    size = _batch_axis_size(distribution) * distribution.num_processes
    single = isinstance(inputs, str)
    prompts = [inputs] if single else inputs
    count = sample_count(prompts) if not hasattr(prompts, "element_spec") else None
    if size == 1 or count is None or count % size == 0:
        return generate(inputs, *args, **kwargs)
    warn_padding(getattr(generate, "__self__", generate), "generate", count, size)
    target = -(-count // size) * size
    if isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts):
        padded = list(prompts) + [prompts[-1]] * (target - count)
    else:
        padded = _pad_rows(prompts, count, target)
    outputs = generate(padded, *args, **kwargs)
    if isinstance(outputs, (list, tuple)):
        outputs = outputs[:count]
    else:
        outputs = keras.tree.map_structure(lambda leaf: leaf[:count], outputs)
    return outputs[0] if single else outputs
