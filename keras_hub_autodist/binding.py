"""A model bound to its distribution: its methods run inside its scope.

Keras and keras-hub read the *global* distribution when a method runs, so a
model loaded inside a `ModelParallel` scope and used outside it loses data
parallelism or meets "incompatible devices" errors. A bound model enters its
own distribution's scope around each method that creates variables or feeds
batches, and leaves the global distribution as it found it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import keras
import numpy as np

from keras_hub_autodist.errors import BatchSizeError
from keras_hub_autodist.errors import NotBoundError
from keras_hub_autodist.plan import LayoutPlan
from keras_hub_autodist.saving import save_atomically

# Methods run inside the model's distribution scope.
BOUND_METHODS = (
    "compile",
    "fit",
    "evaluate",
    "predict",
    "generate",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
    "enable_lora",
    "quantize",
    "save_to_preset",
)
# Keras' default batch size for arrays passed without `batch_size`.
KERAS_DEFAULT_BATCH_SIZE = 32
_BINDING_ATTR = "_keras_hub_autodist_binding"


class Binding(NamedTuple):
    """What `distribution_of(model)` returns.

    Args:
        distribution: the `keras.distribution.ModelParallel` of the model.
        plan: the `LayoutPlan` its weights were laid out with.
    """

    distribution: keras.distribution.Distribution
    plan: LayoutPlan


def distribution_of(model) -> Binding:
    """The distribution and plan a model was loaded with.

    Args:
        model: a model returned by `from_preset(..., device_mesh=...)`.

    Example:
    ```python
    lm = keras_hub.models.GemmaCausalLM.from_preset(path, device_mesh=mesh)
    distribution, plan = keras_hub_autodist.distribution_of(lm)
    ```
    """
    binding = getattr(model, _BINDING_ATTR, None)
    if binding is None:
        raise NotBoundError(
            "This model is not bound to a distribution: load it with "
            "`from_preset(..., device_mesh=mesh)`. Received: model of type "
            f"{type(model).__name__}"
        )
    return binding


def _sample_count(x):
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


def _batch_axis_size(distribution) -> int:
    mesh = distribution.device_mesh
    return mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)]


def rows_multiple(distribution) -> int:
    """Rows a process-local batch must be a multiple of.

    The global batch (local rows × processes) must divide the batch axis.
    """
    axis_size = _batch_axis_size(distribution)
    return axis_size // math.gcd(axis_size, distribution.num_processes)


# Loss reductions that divide by the number of rows of the batch: a padded
# batch needs its real rows' weights scaled by padded/real rows.
_ROW_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")


def _scales_padded_rows(model) -> bool:
    losses = [loss for loss in keras.tree.flatten(getattr(model, "loss", None)) if loss]
    reductions = {getattr(loss, "reduction", "sum_over_batch_size") for loss in losses}
    return bool(reductions & set(_ROW_MEAN_REDUCTIONS))


def _is_tf(leaf) -> bool:
    return type(leaf).__module__.startswith("tensorflow")


def pad_batch(data, multiple: int, scale: bool):
    """Pad a batch up to a multiple of `multiple` rows with zero-weight rows.

    Extra rows repeat the last row (any dtype, strings included) and get
    sample weight 0; when the loss divides by the number of rows (`scale`),
    the real rows' weights are multiplied by padded/real rows, so that the
    loss and its gradient equal those of the unpadded batch. Works on NumPy
    (and JAX) arrays and inside a `tf.data` map.

    Args:
        data: `x`, or `(x, y)` / `(x, y, sample_weight)` as keras packs them.
        multiple: the rows of the result are a multiple of it.
        scale: scale the real rows' weights (see above).

    Example:
    ```python
    x, y, w = pad_batch((np.ones((2, 3)), np.ones((2,))), 4, scale=True)
    # x.shape == (4, 3); w == [2., 2., 0., 0.]
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
        factor = tf.cast(target, "float32") / tf.cast(count, "float32")

        def take(leaf):
            return tf.gather(leaf, index)

        def weights(rows):
            rows = tf.cast(rows, "float32")
            mask = tf.reshape(real, [-1] + [1] * (rows.shape.rank - 1))
            return tf.where(mask, rows * (factor if scale else 1.0), 0.0)

        def ones(label):
            shape = tf.shape(label)
            if not label.dtype.is_integer and label.shape.rank > 1:
                shape = shape[:-1]
            return tf.ones(shape)

    else:
        count = int(first.shape[0])
        if count % multiple == 0:
            return data
        target = -(-count // multiple) * multiple
        index = np.minimum(np.arange(target), count - 1)
        real = np.arange(target) < count

        def take(leaf):
            return np.take(np.asarray(leaf), index, axis=0)

        def weights(rows):
            rows = np.asarray(rows, dtype="float32")
            mask = real.reshape((-1,) + (1,) * (rows.ndim - 1))
            factor = target / count if scale else 1.0
            return np.where(mask, rows * factor, 0.0).astype("float32")

        def ones(label):
            shape = np.shape(label)
            if not np.issubdtype(np.asarray(label).dtype, np.integer):
                shape = shape[:1] + shape[1:-1]
            return np.ones(shape, dtype="float32")

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
    return pad(x), pad(y), keras.tree.map_structure(weights, pad(sample_weight))


def _batch_sizes(x, batch_size, steps=None):
    """Rows of each batch `predict` makes of `x`, or None if unknown."""
    if hasattr(x, "element_spec") and hasattr(x, "map"):
        import tensorflow as tf

        def rows(*element):
            return tf.shape(tf.nest.flatten(element)[0])[0]

        x = x if steps is None else x.take(steps)
        return [int(n) for n in x.map(rows)]
    count = _sample_count(x)
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


def _padding_preprocess(preprocess_samples, model, multiple):
    @functools.wraps(preprocess_samples)
    def call(x, y=None, sample_weight=None):
        data = preprocess_samples(x, y, sample_weight)
        return pad_batch(data, multiple, scale=_scales_padded_rows(model))

    call.__keras_hub_autodist_scoped__ = True
    return call


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
    count = _sample_count(x)
    if count is None:
        return
    if method.endswith("_on_batch"):
        if (count * processes) % axis_size:
            fail(count, "The batch size")
        return
    if method == "generate":
        return
    batch_size = kwargs.get("batch_size")
    if batch_size is None:
        positional = {"fit": 2, "evaluate": 2, "predict": 1}
        index = positional.get(method)
        if index is not None and len(args) > index and args[index] is not None:
            batch_size = args[index]
    batch_size = batch_size or KERAS_DEFAULT_BATCH_SIZE
    full = min(batch_size, count)
    if (full * processes) % axis_size:
        fail(full, "The batch size")
    remainder = count % batch_size if count > batch_size else 0
    if (remainder * processes) % axis_size:
        fail(
            remainder,
            f"The last batch of {count} samples in batches of {batch_size}",
        )


def adopt_optimizer(optimizer, distribution) -> None:
    """Move an optimizer's existing variables onto the distribution's mesh.

    `keras.optimizers.Adam(...)` built before `compile` owns single-device
    variables (`iterations`, `learning_rate`); mixing them with sharded
    weights fails with "incompatible devices for jitted computation". They
    are replicated over the mesh here; slots created later by `build()`
    inside the scope follow their weights' layouts.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    mesh = distribution.device_mesh
    mesh_devices = set(np.ravel(mesh.backend_mesh.devices))
    for variable in optimizer.variables:
        value = variable.value
        sharding = getattr(value, "sharding", None)
        if sharding is not None and set(sharding.device_set) == mesh_devices:
            continue
        layout = keras.distribution.TensorLayout([None] * len(variable.shape), mesh)
        variable.assign(keras.distribution.distribute_tensor(value, layout))


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
    count = _sample_count(prompts) if not hasattr(prompts, "element_spec") else None
    if size == 1 or count is None or count % size == 0:
        return generate(inputs, *args, **kwargs)
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


def _scoped(name, method, distribution, padded=False):
    multiple = rows_multiple(distribution)

    @functools.wraps(method)
    def call(*args, **kwargs):
        feeds = name in ("fit", "evaluate", "predict") or name.endswith("_on_batch")
        if feeds and not padded:
            check_batch(distribution, name, args, kwargs)
        if name == "compile":
            adopt_optimizer(
                kwargs.get("optimizer", args[0] if args else None), distribution
            )
        with distribution.scope():
            if name == "generate" and (args or kwargs.get("inputs") is not None):
                inputs = args[0] if args else kwargs.pop("inputs")
                return generate_padded(
                    method, distribution, inputs, *args[1:], **kwargs
                )
            if padded and name == "predict":
                return predict_unpadded(method, multiple, *args, **kwargs)
            if padded and name == "predict_on_batch":
                rows = _sample_count(args[0] if args else kwargs.get("x"))
                outputs = method(*args, **kwargs)
                return keras.tree.map_structure(lambda o: o[:rows], outputs)
            if name == "save_to_preset" and (args or "preset_dir" in kwargs):
                if not args:
                    args = (kwargs.pop("preset_dir"),)
                return save_atomically(method, *args, **kwargs)
            return method(*args, **kwargs)

    call.__keras_hub_autodist_scoped__ = True
    return call


def bind(model, distribution, plan: LayoutPlan):
    """Bind `model` (and its backbone) to `distribution`; return the model.

    Args:
        model: a keras-hub `Backbone` or `Task`.
        distribution: the `ModelParallel` its weights were created under.
        plan: the `LayoutPlan` behind that distribution.
    """
    binding = Binding(distribution, plan)
    targets = [model]
    backbone = getattr(model, "backbone", None)
    if backbone is not None and backbone is not model:
        targets.append(backbone)
    multiple = rows_multiple(distribution)
    for target in targets:
        object.__setattr__(target, _BINDING_ATTR, binding)
        # keras-hub's Tasks send every batch (fit, validation, evaluate,
        # predict, *_on_batch) through `preprocess_samples`: batches that don't
        # divide the batch axis are padded there (see `pad_batch`).
        preprocess = getattr(target, "preprocess_samples", None)
        padded = preprocess is not None and multiple > 1
        if padded and not getattr(preprocess, "__keras_hub_autodist_scoped__", 0):
            object.__setattr__(
                target,
                "preprocess_samples",
                _padding_preprocess(preprocess, target, multiple),
            )
        for name in BOUND_METHODS:
            method = getattr(target, name, None)
            if method is None or getattr(
                method, "__keras_hub_autodist_scoped__", False
            ):
                continue
            object.__setattr__(
                target, name, _scoped(name, method, distribution, padded)
            )
    return model
