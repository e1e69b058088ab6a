"""A bound method that raises leaves the model's state as it was.

Keras' JAX loops take the values off the model's variables while they run
(`_get_jax_state(purge_model_variables=True)`) and pass them from step to
step, putting them back at the end. An error in the middle (a batch that
won't split, a step that raises, a callback that raises) leaves the
variables empty, or with the values of another call. Around each bound
method that feeds batches, `keeping_state` records the last consistent
state: the values at the start (for the loops that take the values off the
variables), then the state each step receives and the state it returns.
When the method raises, every variable of the model, its optimizer and its
metrics gets that state back:

- an error while drawing a batch or inside a step: the state before that
  step;
- an error elsewhere (a callback, between epochs): the state after the last
  step that finished, which is what the callback saw.

A step that fails after consuming its input (Keras donates the state's
buffers to a compiled step) leaves nothing to restore: `StateLostError`,
never a partial restore.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.errors import StateLostError

# The state a Keras step function receives and returns, by function.
_STEP_GROUPS = {
    "train_function": ("trainable", "non_trainable", "optimizer", "metrics"),
    "test_function": ("trainable", "non_trainable", "metrics"),
    "predict_function": ("trainable", "non_trainable"),
}
_ALL_GROUPS = _STEP_GROUPS["train_function"]
# Keras' loops that take the values off the model's variables while they
# run: their state is kept from the start. The `*_on_batch` methods leave
# the values on the variables until their step runs, and the step records
# the state it receives, so they keep nothing before it: reading every
# variable of the model on each call would cost every batch host time.
_LOOPS_TAKING_VALUES = ("fit", "evaluate", "predict")
# Marks a step function this module already wraps.
_RECORDING_ATTR = "__keras_hub_autodist_recording__"
# The keepers of the bound methods running in this thread, innermost last.
_KEEPERS = contextvars.ContextVar("keras_hub_autodist_keepers", default=())


def _group(model, name: str) -> list:
    if name == "trainable":
        return list(model.trainable_variables)
    if name == "non_trainable":
        return list(model.non_trainable_variables)
    if name == "optimizer":
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return list(optimizer.variables)
        return []
    return list(getattr(model, "metrics_variables", []))


class _Keeper:
    """The last consistent state of one bound method's call."""

    def __init__(self, model, method: str):
        self.model = model
        self.method = method
        self.groups = _ALL_GROUPS
        self.values = None  # the variables hold the state
        if method in _LOOPS_TAKING_VALUES:
            self.values = tuple(
                [compat.variable_value_or_none(v) for v in _group(model, name)]
                for name in _ALL_GROUPS
            )

    def record(self, function: str, state) -> None:
        self.groups = _STEP_GROUPS[function]
        self.values = tuple(list(values or ()) for values in state)

    def restore(self, error: BaseException) -> None:
        if self.values is None:
            return  # no step ran: the variables kept their values
        pairs = []
        for name, values in zip(self.groups, self.values):
            variables = _group(self.model, name)
            if len(values) != len(variables):
                continue  # built during the call: nothing held it before
            pairs += zip(variables, values)
        lost = [
            variable.path
            for variable, value in pairs
            if value is None or getattr(value, "is_deleted", lambda: False)()
        ]
        if lost:
            raise StateLostError(
                f"{self.method}() failed inside a compiled step after the step "
                f"had consumed the model's state, so {len(lost)} variables "
                f"(first: {lost[0]!r}) can't be put back as they were. Reload "
                "the model (its preset, or your last checkpoint) before using "
                f"it again. Received: {type(error).__name__}: {error}"
            ) from error
        for variable, value in pairs:
            variable.assign(value)


def _keepers_of(model) -> list:
    return [keeper for keeper in _KEEPERS.get() if keeper.model is model]


@contextlib.contextmanager
def keeping_state(model, method: str) -> Iterator[None]:
    """Run the block; if it raises, give `model` (its variables, optimizer
    and metrics) the last consistent state (module docstring), then
    re-raise.

    Example:
    ```python
    with keeping_state(lm, "fit"):
        lm.fit(dataset)  # a callback raises: weights as the callback saw them
    ```
    """
    keeper = _Keeper(model, method)
    token = _KEEPERS.set(_KEEPERS.get() + (keeper,))
    try:
        yield
    except BaseException as error:
        keeper.restore(error)
        raise
    finally:
        _KEEPERS.reset(token)


def _recording(function: str, step, model):
    @functools.wraps(step)
    def call(state, data):
        # Every running call of the model records: a nested call (`fit`'s
        # validation) passes the state on, and donates what it received.
        keepers = _keepers_of(model)
        for keeper in keepers:
            keeper.record(function, state)
        outputs, state = step(state, data)
        for keeper in keepers:
            keeper.record(function, state)
        return outputs, state

    setattr(call, _RECORDING_ATTR, True)
    return call


def record_steps(model, function: str) -> None:
    """Make `model`'s step function `function` (`train_function`,
    `test_function` or `predict_function`, as Keras' `make_*_function` set
    it) record the state it receives and returns for `keeping_state`."""
    step = getattr(model, function, None)
    if step is None or getattr(step, _RECORDING_ATTR, False):
        return
    compat.patch_instance(
        "kept_state_steps", model, function, _recording(function, step, model)
    )
