"""Whether a causal LM's step is one the chunked loss reproduces exactly:
keras-hub's default loss and accuracy, run by Keras' own training step.

The chunked step (`chunked_steps`) computes each token's cross-entropy and
argmax itself, so it may stand in only where what it computes is what the
compiled objects would have computed from whole logits:

- the loss is `keras.losses.SparseCategoricalCrossentropy` itself (not a
  subclass, which may compute anything in its `call`), wrapping Keras' own
  `sparse_categorical_crossentropy` with `from_logits=True`,
  `ignore_class=None` (the class it ignores would mask tokens, which
  changes the mean) and `axis=-1`, in float32 (the chunked cross-entropy is
  float32), with a reduction that sums or averages the per-token values
  (the reduction itself stays Keras': the values go through the loss);
- each metric is `keras.metrics.SparseCategoricalAccuracy` itself,
  wrapping Keras' own `sparse_categorical_accuracy` without arguments;
- neither object has a method of its own in place of its class's;
- the task runs Keras' own step: its class replaces none of the trainer
  methods the step runs through, nor the Functional graph's `call`, and
  none was replaced on the instance before it was bound.

Anything else keeps Keras' whole-logits step, unchanged.
"""

from __future__ import annotations

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.compat import steps as compat_steps

# The arguments of keras-hub's default loss that change what it computes.
DEFAULT_LOSS_ARGUMENTS = {"from_logits": True, "ignore_class": None, "axis": -1}
# The reductions that sum or average per-token values, each with a gradient
# per token proportional to its sample weight (what the chunked gradient of
# the head's weights needs, `chunked_cross_entropy`); `None` ("none") hands
# the per-token values to Keras' compiled loss, which reduces them again.
CHUNKED_REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")
# The dtype the chunked cross-entropy computes in.
CHUNKED_DTYPE = "float32"
# On a task: the step methods replaced on the instance before it was bound.
_REPLACED_ATTR = "__keras_hub_autodist_replaced_step_methods__"


def _replaced_step_methods(task) -> list[str]:
    """The step's methods (`compat_steps.STEP_METHODS`, `call`) that the
    instance replaces with functions of its own (not this package's
    patches)."""
    names = (*compat_steps.STEP_METHODS, "call")
    return [
        name
        for name in names
        if name in vars(task) and not compat.is_instance_patch(vars(task)[name])
    ]


def note_replaced_step_methods(task) -> None:
    """Record which of the step's methods the instance replaces with its
    own before the chunked step wraps them (wrapped, they look like this
    package's)."""
    object.__setattr__(task, _REPLACED_ATTR, tuple(_replaced_step_methods(task)))


def why_not_keras_step(task) -> str | None:
    """Why `task`'s step is not Keras' own; None where it is."""
    overridden = compat_steps.overridden_step_methods(task)
    if overridden:
        return (
            f"its class {type(task).__name__} defines {', '.join(overridden)} "
            "in place of Keras'"
        )
    replaced = sorted(
        {*getattr(task, _REPLACED_ATTR, ()), *_replaced_step_methods(task)}
    )
    if replaced:
        return f"the model's {', '.join(replaced)} was replaced on the instance"
    return None


def _replaced_methods(obj) -> list[str]:
    """The methods of `obj`'s class that `obj` replaces with its own."""
    return sorted(
        name
        for name, value in vars(obj).items()
        if callable(value) and callable(getattr(type(obj), name, None))
    )


def why_not_default_loss(loss) -> str | None:
    """Why `loss` is not keras-hub's default cross-entropy, computed as
    the chunked loss computes it; None where it is."""
    expected = keras.losses.SparseCategoricalCrossentropy
    if type(loss) is not expected:
        if isinstance(loss, expected):
            return (
                f"its compiled loss is {type(loss).__name__}, a subclass of "
                "SparseCategoricalCrossentropy whose computation may differ"
            )
        return f"its compiled loss is {loss!r}, not keras-hub's cross-entropy"
    replaced = _replaced_methods(loss)
    if replaced:
        return f"its compiled loss replaces {', '.join(replaced)} on the instance"
    function, arguments = compat_steps.loss_function(loss)
    if function is not keras.losses.sparse_categorical_crossentropy:
        return f"its compiled loss computes {function!r}, not the cross-entropy"
    if arguments != DEFAULT_LOSS_ARGUMENTS:
        shown = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
        return f"its cross-entropy is compiled with {shown}"
    if loss.reduction not in CHUNKED_REDUCTIONS:
        return f"its cross-entropy is compiled with reduction={loss.reduction!r}"
    if loss.dtype != CHUNKED_DTYPE:
        return f"its cross-entropy computes in {loss.dtype}"
    return None


def why_not_default_metric(metric) -> str | None:
    """Why `metric` is not keras-hub's default accuracy; None where it
    is."""
    expected = keras.metrics.SparseCategoricalAccuracy
    if type(metric) is not expected:
        return f"its compiled metric {metric!r} reads whole logits"
    replaced = _replaced_methods(metric)
    function, arguments = compat_steps.metric_function(metric)
    if (
        replaced
        or function is not keras.metrics.sparse_categorical_accuracy
        or arguments
    ):
        return f"its compiled metric {metric.name!r} is not Keras' own accuracy"
    return None
