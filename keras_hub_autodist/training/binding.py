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

import contextlib
import dataclasses
import functools
from typing import Any
from typing import NamedTuple

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.compat import steps as compat_steps
from keras_hub_autodist.errors import NotBoundError
from keras_hub_autodist.fitting.layout_plan import LayoutPlan
from keras_hub_autodist.loss.chunked_steps import install_chunked_loss
from keras_hub_autodist.loss.label_range import warn_labels_outside_vocabulary
from keras_hub_autodist.planning.distribution import decoding
from keras_hub_autodist.saving.atomic import save_atomically
from keras_hub_autodist.saving.gathering import save_from_every_process
from keras_hub_autodist.saving.gathering import several_processes
from keras_hub_autodist.training.batch_placement import placing_each_array_once
from keras_hub_autodist.training.batches import check_batch
from keras_hub_autodist.training.batches import feeding_rows
from keras_hub_autodist.training.batches import generate_padded
from keras_hub_autodist.training.batches import on_padded_batch
from keras_hub_autodist.training.batches import padding_preprocess
from keras_hub_autodist.training.batches import predict_unpadded
from keras_hub_autodist.training.batches import requested_rows
from keras_hub_autodist.training.batches import rows_multiple
from keras_hub_autodist.training.batches import sample_count
from keras_hub_autodist.training.batches import warn_padding
from keras_hub_autodist.training.drawn_batches import check_sequences_first
from keras_hub_autodist.training.drawn_batches import checking_drawn_batches
from keras_hub_autodist.training.keeping import keeping_state
from keras_hub_autodist.training.keeping import record_steps
from keras_hub_autodist.training.padded_steps import count_real_rows
from keras_hub_autodist.training.placement import keeping_values_on_mesh
from keras_hub_autodist.training.placement import place_state
from keras_hub_autodist.training.restore import note_compiled
from keras_hub_autodist.training.restore import restore
from keras_hub_autodist.training.weights_files import recording_fingerprint

_BINDING_ATTR = "_keras_hub_autodist_binding"
# Marks a method this module already wrapped.
_WRAPPED_ATTR = "__keras_hub_autodist_scoped__"


class Binding(NamedTuple):
    """What `distribution_of(model)` returns.

    Attributes:
        distribution: the `keras.distribution.ModelParallel` of the model.
        plan: the `LayoutPlan` its weights were laid out with.
    """

    distribution: keras.distribution.Distribution
    plan: LayoutPlan


def distribution_of(model: keras.Model) -> Binding:
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


@dataclasses.dataclass(frozen=True)
class _Bound:
    """What a wrapped method of a bound model needs: the model, its
    distribution, and the rows a batch must be a multiple of (batches are
    padded in `preprocess_samples` when `padded`)."""

    model: Any
    distribution: keras.distribution.Distribution
    multiple: int
    padded: bool


@contextlib.contextmanager
def _loop(name, bound, args, kwargs):
    """Around a method that feeds batches: its inputs checked before Keras'
    loop starts, each batch it draws checked before it reaches a step, the
    model's state put back if it raises (`keeping.py`), in the scope."""
    if not bound.padded:
        check_batch(bound.distribution, name, args, kwargs)
    check_sequences_first(bound.distribution, bound.model, name, args, kwargs)
    warn_labels_outside_vocabulary(bound.model, name, args, kwargs)
    with (
        keeping_state(bound.model, name),
        checking_drawn_batches(bound.distribution, name),
        keeping_values_on_mesh(bound.distribution, name),
        bound.distribution.scope(),
    ):
        yield


def _warn_padding(name, bound, args, kwargs):
    """`PaddingWarning`, once per model and method, when a padded task's
    batches of the rows its caller asked for are padded."""
    if not bound.padded:
        return
    if name.endswith("_on_batch"):
        rows = sample_count(args[0] if args else kwargs.get("x"))
    else:
        rows = requested_rows(name, args, kwargs)
    warn_padding(bound.model, name, rows, bound.multiple)


def _feeding(name, method, bound, args, kwargs):
    """A method that feeds batches: each checked against the batch axis
    (unless keras-hub's preprocessing pads them), run in `_loop`."""
    _warn_padding(name, bound, args, kwargs)
    with _loop(name, bound, args, kwargs):
        return method(*args, **kwargs)


def _on_batch(name, method, bound, args, kwargs):
    """`train_on_batch`/`test_on_batch`: `_feeding`; a padded task's batch
    (marked, `padded_steps`) goes to Keras' own method, as keras-hub's
    would after preprocessing it, but with the mark kept whole."""
    with placing_each_array_once():
        if not bound.padded:
            return _feeding(name, method, bound, args, kwargs)
        _warn_padding(name, bound, args, kwargs)
        with _loop(name, bound, args, kwargs):
            return on_padded_batch(bound.model, name, *args, **kwargs)


def _fitting(name, method, bound, args, kwargs):
    """`fit`: `_feeding`, with the rows per batch its caller asked for known
    to its callbacks (`batches.fed_rows`: a checkpoint records them)."""
    with feeding_rows(requested_rows(name, args, kwargs)):
        return _feeding(name, method, bound, args, kwargs)


def _in_scope(name, method, bound, args, kwargs):
    with bound.distribution.scope():
        return method(*args, **kwargs)


def _compiling(name, method, bound, args, kwargs):
    """`compile`, then the new optimizer's and metrics' variables placed."""
    with bound.distribution.scope():
        result = method(*args, **kwargs)
        place_state(bound.model, bound.distribution)
        note_compiled(bound.model)
        if bound.padded:
            count_real_rows(bound.model)  # the new loss tracker
        return result


def _predicting(name, method, bound, args, kwargs):
    """`predict`: padded rows dropped from the outputs."""
    if not bound.padded:
        return _feeding(name, method, bound, args, kwargs)
    _warn_padding(name, bound, args, kwargs)
    with _loop(name, bound, args, kwargs):
        return predict_unpadded(method, bound.multiple, *args, **kwargs)


def _predicting_on_batch(name, method, bound, args, kwargs):
    """`predict_on_batch`: padded rows dropped from the outputs."""
    if not bound.padded:
        return _feeding(name, method, bound, args, kwargs)
    _warn_padding(name, bound, args, kwargs)
    rows = sample_count(args[0] if args else kwargs.get("x"))
    with _loop(name, bound, args, kwargs):
        outputs = method(*args, **kwargs)
    return keras.tree.map_structure(lambda output: output[:rows], outputs)


def _generating(name, method, bound, args, kwargs):
    """`generate` on prompts: padded to the batch axis, padding dropped."""
    if not args and kwargs.get("inputs") is None:
        return _in_scope(name, method, bound, args, kwargs)
    inputs = args[0] if args else kwargs.pop("inputs")
    with bound.distribution.scope(), decoding():
        return generate_padded(method, bound.distribution, inputs, *args[1:], **kwargs)


def _restoring(name, method, bound, args, kwargs):
    """`load_weights`: the whole training state, or `RestoreError`."""
    with bound.distribution.scope():
        return restore(method, bound.model, bound.distribution, *args, **kwargs)


def _saving(path_argument: str, whole_folder: bool):
    """A save method whose path is `path_argument`: a preset folder swapped
    in whole (`whole_folder`), and, with several processes, run in every process
    with process 0 writing. A weights file (`save_weights`, `save`) records
    the model's fingerprint; a preset, and the saves it makes, record none."""

    def save(name, method, bound, args, kwargs):
        if not args and path_argument not in kwargs:
            return _in_scope(name, method, bound, args, kwargs)
        if not args:
            args = (kwargs.pop(path_argument),)
        with (
            recording_fingerprint(bound.model, preset=whole_folder),
            bound.distribution.scope(),
        ):
            if several_processes():
                return save_from_every_process(
                    method, *args, whole_folder=whole_folder, **kwargs
                )
            if whole_folder:
                return save_atomically(method, *args, **kwargs)
            return method(*args, **kwargs)

    return save


def _placing(name, method, bound, args, kwargs):
    """A maker of jitted steps: when it will make one, every variable placed
    on the mesh first, outside the scope (the step takes the state's
    shardings); the step it makes records its state
    (`keeping.record_steps`). Keras asks for the step before every batch
    (`train_on_batch` included) and gets the one it made, whose variables
    were placed then and keep their lasting layouts: placing them again
    would walk every variable of the model on each call."""
    function = name.replace("make_", "")
    force = kwargs.get("force", args[0] if args else False)
    if getattr(bound.model, function, None) is None or force:
        place_state(bound.model, bound.distribution)
    result = method(*args, **kwargs)
    record_steps(bound.model, function)
    return result


# Each method a bound model wraps, and how it runs.
BOUND_METHODS = {
    "compile": _compiling,
    "fit": _fitting,
    "evaluate": _feeding,
    "train_on_batch": _on_batch,
    "test_on_batch": _on_batch,
    "predict": _predicting,
    "predict_on_batch": _predicting_on_batch,
    "generate": _generating,
    "enable_lora": _in_scope,
    "quantize": _in_scope,
    "load_weights": _restoring,
    "save_to_preset": _saving("preset_dir", whole_folder=True),
    "save_weights": _saving("filepath", whole_folder=False),
    "save": _saving("filepath", whole_folder=False),
    "make_train_function": _placing,
    "make_test_function": _placing,
    "make_predict_function": _placing,
}


def _wrapped(name, method, runs, bound: _Bound):
    @functools.wraps(method)
    def call(*args, **kwargs):
        return runs(name, method, bound, args, kwargs)

    setattr(call, _WRAPPED_ATTR, True)
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
        if padded and not getattr(preprocess, _WRAPPED_ATTR, False):
            compat.patch_instance(
                "bound_model_methods",
                target,
                "preprocess_samples",
                padding_preprocess(preprocess, multiple),
            )
        if target is model:
            install_chunked_loss(target, plan)
        if padded:
            count_real_rows(target)
        if hasattr(target, "jax_state_sync"):
            compat.patch_instance(
                "layout_checked_state_sync",
                target,
                "jax_state_sync",
                compat_steps.layout_checked_state_sync(target),
            )
        bound = _Bound(target, distribution, multiple, padded)
        for name, runs in BOUND_METHODS.items():
            method = getattr(target, name, None)
            if method is None or getattr(method, _WRAPPED_ATTR, False):
                continue
            compat.patch_instance(
                "bound_model_methods", target, name, _wrapped(name, method, runs, bound)
            )
    return model
