"""One line on what `from_preset(..., device_mesh=)` did: the mesh (and
why, when `"auto"` chose it), the strategy, and GiB per device for the
weights and for training with Adam.

`from_preset` prints it once the model is loaded, when Keras' interactive
logging is on (its default; `keras.config.disable_interactive_logging()`
silences it, as it silences Keras' own progress bars), from process 0 only.

Example:
```python
lm = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b", device_mesh="auto")
keras_hub_autodist.summary(lm)
# 'GemmaBackbone on mesh batch=8, model=1 (auto over 8 devices: ...), strategy tp,
#  per device: 0.59 GiB of weights, about 2.34 GiB to train with Adam'
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_hub_autodist.fitting import memory
from keras_hub_autodist.fitting.device_memory import GIB
from keras_hub_autodist.planning.plan_record import PlanRecord

if TYPE_CHECKING:
    import keras


def summary_line(plan: PlanRecord) -> str:
    """The one-line summary of `plan`.

    Args:
        plan: a `LayoutPlan`.

    Returns:
        E.g. `GemmaBackbone on mesh batch=2, model=4, strategy tp, per
        device: 0.59 GiB of weights, about 2.34 GiB to train with Adam`.
    """
    reason = f" ({plan.mesh_reason})" if plan.mesh_reason else ""
    training = memory.training_bytes_per_device(plan)
    return (
        f"{plan.backbone_class} on mesh {plan.mesh_axes.describe()}{reason}, "
        f"strategy {plan.strategy}, per device: "
        f"{plan.max_device_bytes / GIB:.2f} GiB of weights, about "
        f"{training / GIB:.2f} GiB to train with Adam"
    )


def summary(model_or_plan: keras.Model | PlanRecord) -> str:
    """The one-line summary of a model bound by `from_preset(device_mesh=)`,
    or of a `LayoutPlan`.

    Args:
        model_or_plan: a bound model (task or backbone) or a plan.

    Returns:
        The line `from_preset` prints (`summary_line`).

    Raises:
        NotBoundError: for a model that `from_preset` did not bind.
    """
    if isinstance(model_or_plan, PlanRecord):
        return summary_line(model_or_plan)
    from keras_hub_autodist.training.binding import distribution_of

    return summary_line(distribution_of(model_or_plan).plan)


def print_summary(plan: PlanRecord) -> None:
    """Print `summary_line(plan)` as Keras prints its own messages: when
    interactive logging is on, from process 0."""
    import jax
    import keras

    if keras.config.is_interactive_logging_enabled() and jax.process_index() == 0:
        print(summary_line(plan))
