"""The arguments of `compiled_memory` checked before anything is read,
built or compiled: the kind of each declared once (`ARGUMENT_KINDS`), and a
task class checked against the plan's backbone (`check_model_class`).

`batch_size`, `sequence_length` (`step_shape.runnable_step`), `optimizer`
(`built_optimizer`), `lora_rank`, `preset` and `device_mesh` are checked
where they are read, also before anything is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import ModelClassError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.trained_state import OPTIMIZERS
from keras_hub_autodist.planning.plan_record import PlanRecord


@dataclasses.dataclass(frozen=True)
class ArgumentKind:
    """What one argument of `compiled_memory` accepts.

    Args:
        name: the argument.
        accepts: whether a value is of an accepted kind.
        what: what the argument is, for the error.
        example: how to pass it, for the error.
    """

    name: str
    accepts: Callable[[Any], bool]
    what: str
    example: str


ARGUMENT_KINDS = (
    ArgumentKind(
        "plan",
        lambda value: isinstance(value, PlanRecord),
        "a plan made by `keras_hub_autodist.plan()`",
        'plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})',
    ),
    ArgumentKind(
        "device",
        lambda value: value is None or isinstance(value, str),
        "the name of an accelerator to compile for, or None (this machine's)",
        'device="v5e"',
    ),
    ArgumentKind(
        "gradient_accumulation_steps",
        lambda value: (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ),
        "how many steps' gradients make one optimizer update (1: each step's)",
        "gradient_accumulation_steps=4",
    ),
    ArgumentKind(
        "timed_steps",
        lambda value: (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ),
        "how many runs of the step to time on this machine's devices (0: none)",
        "timed_steps=5",
    ),
    ArgumentKind(
        "model_class",
        lambda value: value is None or isinstance(value, type),
        "the keras-hub task class to train, or None (the backbone's CausalLM)",
        "model_class=keras_hub.models.GemmaCausalLM",
    ),
)


def check_argument_kinds(**arguments) -> None:
    """Raise `ArgumentError` for an argument of `compiled_memory` of a kind
    it doesn't accept (`ARGUMENT_KINDS`), naming it, what it received and
    how to pass it.

    Example:
    >>> check_argument_kinds(device="v5e")
    """
    for kind in ARGUMENT_KINDS:
        if kind.name in arguments and not kind.accepts(arguments[kind.name]):
            value = arguments[kind.name]
            error = ModelClassError if kind.name == "model_class" else ArgumentError
            raise error(
                f"`{kind.name}` is {kind.what}, e.g. {kind.example}. Received: "
                f"{kind.name}={value!r} ({type(value).__name__})"
            )


def built_optimizer(optimizer, accumulation: int = 1) -> tuple[Any, str]:
    """The Keras optimizer the compiled step trains with, and its name: a
    fresh copy of a `keras.optimizers.Optimizer` (building the user's would
    change it), or the one `trained_state.OPTIMIZERS` names; accumulating
    the gradients of `accumulation` steps where more than 1.

    Example:
    ```python
    built_optimizer("adam", 4)  # (Adam(gradient_accumulation_steps=4), "adam")
    ```
    """
    import keras

    # Keras takes `None` for no accumulation (it refuses 1).
    steps = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    if isinstance(optimizer, keras.optimizers.Optimizer):
        config = {**optimizer.get_config(), **steps}
        return type(optimizer).from_config(config), type(optimizer).__name__.lower()
    if optimizer not in OPTIMIZERS:
        raise PlanError(
            f"The compiled memory check takes an optimizer name, one of "
            f"{sorted(OPTIMIZERS)}, or a `keras.optimizers.Optimizer`. "
            f"Received: optimizer={optimizer!r}"
        )
    spec = OPTIMIZERS[optimizer]
    keras_class = getattr(keras.optimizers, spec.keras_class)
    return keras_class(**dict(spec.keras_kwargs), **steps), optimizer


def default_task_class(backbone_cls: type) -> type:
    """The keras-hub `CausalLM` whose `backbone_cls` is `backbone_cls`.

    Example:
    ```python
    default_task_class(keras_hub.models.GemmaBackbone)  # GemmaCausalLM
    ```
    """
    import keras_hub

    found = []
    pending = [keras_hub.models.CausalLM]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if getattr(cls, "backbone_cls", None) is backbone_cls:
            found.append(cls)
    if not found:
        raise ModelClassError(
            f"keras-hub has no CausalLM for {backbone_cls.__name__}; pass the "
            "task class to compile, e.g. model_class=keras_hub.models."
            f"GemmaCausalLM. Received: backbone class {backbone_cls.__name__}"
        )
    # The most general one: a subclass of a CausalLM (a variant) comes last.
    return min(found, key=lambda cls: len(cls.__mro__))


def check_model_class(model_class: type | None, plan: PlanRecord) -> None:
    """Raise `ModelClassError` unless `model_class` is None or a keras-hub
    task class whose backbone is the plan's.

    Args:
        model_class: the `model_class=` of `compiled_memory`.
        plan: the plan it is compiled for.
    """
    if model_class is None:
        return
    import keras_hub

    from keras_hub_autodist.planning.shapes import backbone_class_named

    if issubclass(model_class, keras_hub.models.Backbone):
        try:
            task = f"keras_hub.models.{default_task_class(model_class).__name__}"
        except ModelClassError:
            task = "its task class"
        raise ModelClassError(
            "`model_class` is the task class to train (the model around a "
            f"backbone), not a backbone class: pass {task}, or None for the "
            "plan's CausalLM. Received: "
            f"model_class={model_class.__name__} (a Backbone)"
        )
    if not issubclass(model_class, keras_hub.models.Task):
        raise ModelClassError(
            "`model_class` is a keras-hub task class, e.g. "
            "keras_hub.models.GemmaCausalLM, or None (the backbone's "
            f"CausalLM). Received: model_class={model_class!r}"
        )
    backbone_cls = backbone_class_named(plan.backbone_class)
    expected = getattr(model_class, "backbone_cls", None)
    if expected is not None and not issubclass(backbone_cls, expected):
        raise ModelClassError(
            f"`model_class` {model_class.__name__} trains a "
            f"{expected.__name__}, but the plan is of a {backbone_cls.__name__}: "
            "pass the task class of the plan's backbone, or None for its "
            f"CausalLM. Received: model_class={model_class.__name__}"
        )
