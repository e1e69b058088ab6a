"""A model bound to its distribution: its methods run inside its scope.

Keras and keras-hub read the *global* distribution when a method runs, so a
model loaded inside a `ModelParallel` scope and used outside it loses data
parallelism or meets "incompatible devices" errors. A bound model enters its
own distribution's scope around each method that creates variables or feeds
batches, and leaves the global distribution as it found it.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import NamedTuple

import keras
import numpy as np

from keras_hub_autodist.errors import BatchSizeError
from keras_hub_autodist.errors import NotBoundError
from keras_hub_autodist.plan import LayoutPlan

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
            f"{method}() with batch size {batch}"
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


def save_atomically(save, preset_dir, *args, **kwargs):
    """Run `save(staging_dir, ...)`, then move the result to `preset_dir`.

    An error while saving leaves `preset_dir` as it was (absent, or with its
    old files): everything is written to a staging folder beside it first,
    and moved into place only once the save completed.
    """
    target = os.path.abspath(os.fspath(preset_dir))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(
        prefix=f".{os.path.basename(target)}.saving-", dir=parent
    )
    try:
        result = save(staging, *args, **kwargs)
        if not os.path.exists(target) or not os.listdir(target):
            if os.path.exists(target):
                os.rmdir(target)
            os.rename(staging, target)
        else:
            for name in os.listdir(staging):
                os.replace(os.path.join(staging, name), os.path.join(target, name))
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _scoped(name, method, distribution):
    @functools.wraps(method)
    def call(*args, **kwargs):
        if name in ("fit", "evaluate", "predict", "generate") or name.endswith(
            "_on_batch"
        ):
            check_batch(distribution, name, args, kwargs)
        if name == "compile":
            adopt_optimizer(
                kwargs.get("optimizer", args[0] if args else None), distribution
            )
        with distribution.scope():
            if name == "generate" and args:
                return generate_padded(method, distribution, *args, **kwargs)
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
    for target in targets:
        object.__setattr__(target, _BINDING_ATTR, binding)
        for name in BOUND_METHODS:
            method = getattr(target, name, None)
            if method is None or getattr(
                method, "__keras_hub_autodist_scoped__", False
            ):
                continue
            object.__setattr__(target, name, _scoped(name, method, distribution))
    return model
