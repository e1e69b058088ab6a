"""A model bound to its distribution: its methods run inside its scope.

Keras and keras-hub read the *global* distribution when a method runs, so a
model loaded inside a `ModelParallel` scope and used outside it loses data
parallelism or meets "incompatible devices" errors. A bound model enters its
own distribution's scope around each method that creates variables or feeds
batches, and leaves the global distribution as it found it.

Around `compile`, a restore (`load_weights`) and every jitted step it makes,
a bound model also places its optimizer and metric variables on its mesh
(`placement.py`); `load_weights` restores the whole training state or raises
(`restore.py`); batches are checked and padded by `batches.py`. With
several processes, its save methods run in every process and process 0
writes (`gathering.py`); `save_weights` and `save` write the model's
fingerprint into their file (`weights_files.py`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import keras

from keras_hub_autodist.batches import check_batch
from keras_hub_autodist.batches import generate_padded
from keras_hub_autodist.batches import padding_preprocess
from keras_hub_autodist.batches import predict_unpadded
from keras_hub_autodist.batches import rows_multiple
from keras_hub_autodist.batches import sample_count
from keras_hub_autodist.errors import NotBoundError
from keras_hub_autodist.gathering import save_from_every_process
from keras_hub_autodist.gathering import several_processes
from keras_hub_autodist.placement import place_state
from keras_hub_autodist.plan import LayoutPlan
from keras_hub_autodist.restore import note_compiled
from keras_hub_autodist.restore import restore
from keras_hub_autodist.saving import save_atomically
from keras_hub_autodist.weights_files import fingerprinted

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
    "load_weights",
    "save_weights",
    "save",
)
# Methods that make a jitted step from the state's shardings: every variable
# is placed on the mesh first (see `placement.py`).
STEP_MAKERS = ("make_train_function", "make_test_function", "make_predict_function")
# Save methods -> the name of their path argument. With several processes,
# they run in every process and process 0 writes (see `gathering.py`).
SAVE_PATH_ARGUMENTS = {
    "save_to_preset": "preset_dir",
    "save_weights": "filepath",
    "save": "filepath",
}
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


def _placing(method, model, distribution):
    @functools.wraps(method)
    def call(*args, **kwargs):
        place_state(model, distribution)
        return method(*args, **kwargs)

    call.__keras_hub_autodist_scoped__ = True
    return call


def _recording_fingerprint(name, method, model):
    """`save_weights` and `save` write the model's fingerprint into their
    file; the saves `save_to_preset` makes write none."""
    if name in ("save_weights", "save"):
        return fingerprinted(method, model)
    if name == "save_to_preset":
        return fingerprinted(method, model, write=False)
    return method


def _scoped(name, method, model, distribution, padded=False):
    multiple = rows_multiple(distribution)
    method = _recording_fingerprint(name, method, model)

    @functools.wraps(method)
    def call(*args, **kwargs):
        feeds = name in ("fit", "evaluate", "predict") or name.endswith("_on_batch")
        if feeds and not padded:
            check_batch(distribution, name, args, kwargs)
        with distribution.scope():
            if name == "compile":
                result = method(*args, **kwargs)
                place_state(model, distribution)
                note_compiled(model)
                return result
            if name == "load_weights":
                return restore(method, model, distribution, *args, **kwargs)
            if name == "generate" and (args or kwargs.get("inputs") is not None):
                inputs = args[0] if args else kwargs.pop("inputs")
                return generate_padded(
                    method, distribution, inputs, *args[1:], **kwargs
                )
            if padded and name == "predict":
                return predict_unpadded(method, multiple, *args, **kwargs)
            if padded and name == "predict_on_batch":
                rows = sample_count(args[0] if args else kwargs.get("x"))
                outputs = method(*args, **kwargs)
                return keras.tree.map_structure(lambda o: o[:rows], outputs)
            path_argument = SAVE_PATH_ARGUMENTS.get(name)
            if path_argument and (args or path_argument in kwargs):
                if not args:
                    args = (kwargs.pop(path_argument),)
                if several_processes():
                    preset = name == "save_to_preset"
                    return save_from_every_process(
                        method, *args, preset=preset, **kwargs
                    )
                if name == "save_to_preset":
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
                padding_preprocess(preprocess, target, multiple),
            )
        for name in BOUND_METHODS + STEP_MAKERS:
            method = getattr(target, name, None)
            if method is None or getattr(
                method, "__keras_hub_autodist_scoped__", False
            ):
                continue
            if name in STEP_MAKERS:
                wrapped = _placing(method, target, distribution)
            else:
                wrapped = _scoped(name, method, target, distribution, padded)
            object.__setattr__(target, name, wrapped)
    return model
