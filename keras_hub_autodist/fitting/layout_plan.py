"""`LayoutPlan`: where every weight of a model goes on a mesh, as a value.

A plan holds values only (`plan_record.PlanRecord`: the rows, the mesh's
axes, the strategy and the reasons behind each choice). It is made by
`planner.plan()`; its methods answer from those values: memory per device
(`memory.py`), the text (`report.py`), the check of a model's variables
(`weight_check.py`), and `layout_map(mesh)` for a `DeviceMesh` of the
planned shape.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import warn
from keras_hub_autodist.fitting import compiled_step
from keras_hub_autodist.fitting import memory
from keras_hub_autodist.fitting import report
from keras_hub_autodist.planning.plan_record import PlanRecord
from keras_hub_autodist.planning.weight_check import WeightCheck


class LayoutPlan(PlanRecord):
    """How a model's weights are laid out on a mesh, computed from its config.

    Build one with `keras_hub_autodist.plan()`; `replace(**changes)` gives a
    changed copy.

    Args:
        preset: what it was planned from (a folder, handle, or a label such
            as `"<config dict>"`).
        backbone_class: the backbone class name.
        architecture: the family whose rule table laid it out.
        mesh_axes: the mesh's axis names, sizes and roles.
        strategy: `"tp"` or `"fsdp"`.
        strategy_reason: why that strategy.
        dtype: the variable dtype.
        rows: one `Weight` per variable, in the model's order.
        device_memory_bytes: the per-device memory planned with.
        device_memory_source: where it comes from: `"given"`, `"env"`,
            `"reported"` or `"assumed"`.
        mesh_reason: why that mesh, when `device_mesh="auto"` chose it.
        config_fields: logical axis → the config field that sets it.
        sequence_parallel: whether residual-stream activations are sharded
            on the sequence over the model axis.
        sequence_parallel_outputs: the family's residual-stream layer
            outputs (`<layer path>/output` patterns).
        lora_rank: the rank of the LoRA fine-tune planned for, or `None`
            (full fine-tuning): what the memory answers train.
        device_name: the named device planned for (`"t4"`), or `""`.
        remat: the rematerialization planned for (`None`, a
            `keras.RematScope` mode or a dict of its arguments).
        final_logit_soft_cap: the model's cap of its output logits (Gemma
            2), or `None`: the memory answers count its buffers.
        mixed_policy: the mixed-precision policy the model computes with
            (`"mixed_bfloat16"`, `"mixed_float16"`; `dtype` is then its
            variables' float32), or `""`: the compiled check builds with it.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    print(plan)                      # table of weights, specs and bytes
    plan.max_device_bytes            # parameter bytes on the fullest device
    layout_map = plan.layout_map(mesh)  # for your own ModelParallel
    ```
    """

    def training_bytes_per_device(self, optimizer: str = "adam") -> int:
        """Estimated per-device bytes of weights + gradients + optimizer state
        (`memory.training_bytes_per_device`)."""
        return memory.training_bytes_per_device(self, optimizer)

    def activation_bytes_per_device(
        self, batch_size: int, sequence_length: int, platform: str = "cpu"
    ) -> int:
        """Estimated per-device bytes of the activations a training step
        saves for its backward pass (`memory.activation_bytes_per_device`)."""
        return memory.activation_bytes_per_device(
            self, batch_size, sequence_length, platform
        )

    def compiled_memory(
        self, batch_size: int, sequence_length: int, optimizer="adam", **options
    ):
        """Deprecated: `keras_hub_autodist.compiled_memory(plan, ...)`.

        Compiling the step reads the preset again, which a plan, a value,
        does not do. Kept for one release.

        Example:
        ```python
        keras_hub_autodist.compiled_memory(plan, 8, 2048, "adam").peak_bytes
        ```
        """
        warn(
            "`LayoutPlan.compiled_memory(...)` is deprecated; call "
            "`keras_hub_autodist.compiled_memory(plan, ...)`.",
            DeprecationWarning,
        )
        return compiled_step.compiled_memory(
            self, batch_size, sequence_length, optimizer, **options
        )

    @property
    def fits(self) -> bool:
        """Whether weights, gradients and Adam state fit each device (of
        the trained weights: the LoRA kernels alone with `lora_rank`).

        Activations come on top: `strategy="auto"` keeps `"tp"` only while
        this leaves room for them (`policy.leaves_room_for_activations`).
        """
        return memory.fits(self)

    def weight_check(self, *, strict: bool = True) -> WeightCheck:
        """A `WeightCheck` of built variables against this plan.

        Args:
            strict: whether a weight that matches no rule is an error
                (`True`) or a warning, the weight staying replicated.

        Example:
        ```python
        check = plan.weight_check()
        check.built(model.weights)
        ```
        """
        return WeightCheck(self, strict=strict)

    def memory_note(self) -> str:
        """Where the per-device memory of this plan comes from."""
        return report.memory_note(self)

    def fit_advice(
        self,
        batch_size: int | None = None,
        sequence_length: int | None = None,
        optimizer: str = "adam",
        platform: str | None = None,
    ) -> list[str]:
        """The advice of the closed form's verdict (`report.fit_advice`):
        none when the step fits, how to settle a maybe, and what would make
        a step that does not fit fit, in order of cost. `platform` defaults
        to the device the plan was made for, else a GPU's."""
        return report.fit_advice(self, batch_size, sequence_length, optimizer, platform)

    def summary(self) -> str:
        """Per-device totals, one line each, and whether the plan fits
        (`keras_hub_autodist.summary(plan)` gives the one-line form)."""
        return report.summary(self)

    def plot(self, weight: str | None = None):
        """A matplotlib figure of the planned memory per device and of
        `weight`'s shards on the mesh (default: the largest weight); see
        `keras_hub_autodist.fitting.plot`. Needs matplotlib.

        Example:
        ```python
        plan.plot("decoder_block_0/attention/query/kernel")
        ```
        """
        from keras_hub_autodist.fitting.plot import plot

        return plot(self, weight)

    def table_groups(self) -> dict[tuple, list[Weight]]:
        """The rows grouped as `table()` shows them (`report.table_groups`)."""
        return report.table_groups(self)

    def table(self) -> str:
        """The weights grouped across layers (`decoder_block_*/...`), with
        shape, spec, bytes and notes."""
        return report.table(self)

    def __str__(self):
        return self.table() + "\n\n" + self.summary()

    def __repr__(self):
        return (
            f"<LayoutPlan preset={self.preset!r} backbone={self.backbone_class} "
            f"mesh=({self.mesh_axes.describe()}) strategy={self.strategy!r} "
            f"max_device_bytes={self.max_device_bytes}>"
        )
