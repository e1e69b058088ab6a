"""`LayoutPlan`: where every weight of a model goes on a mesh, as a value.

A plan holds values only: the rows (one `Weight` each, with its spec), the
mesh's axis names, sizes and roles (`MeshAxes`, never a live `DeviceMesh`),
the strategy and the reasons behind each choice. It is made by
`planner.plan()`; `layout_map(mesh)` turns it into Keras' `LayoutMap` for a
`DeviceMesh` of the planned shape.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING

from keras_hub_autodist import memory
from keras_hub_autodist import report
from keras_hub_autodist import rules
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.mesh import MeshAxes
from keras_hub_autodist.weight import Weight

if TYPE_CHECKING:
    import keras

    from keras_hub_autodist.verify import WeightCheck

# The record of one planned weight (path, pattern, shape, logical axes,
# spec, dtype, bytes, device bytes, fallbacks): the data path's `Weight`.
PlanRow = Weight


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
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

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    print(plan)                      # table of weights, specs and bytes
    plan.max_device_bytes            # parameter bytes on the fullest device
    layout_map = plan.layout_map(mesh)  # for your own ModelParallel
    ```
    """

    preset: str
    backbone_class: str
    architecture: str
    mesh_axes: MeshAxes
    strategy: str
    strategy_reason: str
    dtype: str
    rows: tuple[Weight, ...]
    device_memory_bytes: int
    device_memory_source: str = memory.MEMORY_GIVEN
    mesh_reason: str = ""
    config_fields: Mapping[str, str] = dataclasses.field(
        default_factory=dict, hash=False
    )
    sequence_parallel: bool = False
    sequence_parallel_outputs: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(
            self, "config_fields", types.MappingProxyType(dict(self.config_fields))
        )
        object.__setattr__(
            self, "sequence_parallel_outputs", tuple(self.sequence_parallel_outputs)
        )

    def replace(self, **changes) -> LayoutPlan:
        """A copy of this plan with some fields changed.

        Example:
        ```python
        plan.replace(mesh_reason="chosen by hand")
        ```
        """
        fields = {field.name for field in dataclasses.fields(self)}
        unknown = set(changes) - fields
        if unknown:
            raise PlanError(
                f"A LayoutPlan has no field {sorted(unknown)}; use one of "
                f"{sorted(fields)}. Received: {sorted(changes)}"
            )
        return dataclasses.replace(self, **changes)

    def activation_layouts(self) -> dict[str, tuple]:
        """Layout-map keys of layer outputs (`<layer path>/output`) → spec.

        Each residual-stream output of the family
        (`Architecture.sequence_parallel_outputs`), on `[batch, sequence,
        hidden]`, is pinned

        - `(batch axis, model axis, None)` when the plan is sequence
          parallel and its model axis has more than one device;
        - `(batch axis, None, None)` under `"fsdp"` with a batch axis of
          more than one device. Without the pin XLA may reshard the
          activations to follow the weights' batch-axis sharding (traffic
          that grows with the tokens of the step) instead of gathering the
          weights (fixed per step), which is what fully sharded data
          parallelism means (MaxText pins its activations the same way).

        Otherwise empty.

        Example:
        ```python
        plan = keras_hub_autodist.plan(
            "./gemma_2b", {"batch": 2, "model": 4}, sequence_parallel=True)
        plan.activation_layouts()["final_normalization/output"]
        # ('batch', 'model', None)
        ```
        """
        spec = None
        if self.sequence_parallel:
            spec = rules.sequence_parallel_spec(self.mesh_axes)
        if spec is None and self.strategy == "fsdp":
            spec = rules.fsdp_activation_spec(self.mesh_axes)
        if spec is None:
            return {}
        return {pattern: spec for pattern in self.sequence_parallel_outputs}

    @property
    def batch_axis(self) -> str:
        return self.mesh_axes.batch_axis

    @property
    def total_bytes(self) -> int:
        """Bytes of all weights, unsharded."""
        return sum(row.bytes for row in self.rows)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(row.shape) for row in self.rows)

    @property
    def max_device_bytes(self) -> int:
        """Parameter bytes on the fullest device."""
        # Every axis divides its dimension exactly, so all devices hold the
        # same number of bytes.
        return sum(row.device_bytes for row in self.rows)

    @property
    def ideal_device_bytes(self) -> float:
        """`total_bytes` spread perfectly over every device of the mesh."""
        return self.total_bytes / self.mesh_axes.num_devices

    def training_bytes_per_device(self, optimizer: str = "adam") -> int:
        """Estimated per-device bytes of weights + gradients + optimizer state
        (`memory.training_bytes_per_device`)."""
        return memory.training_bytes_per_device(self, optimizer)

    def activation_bytes_per_device(self, batch_size: int, sequence_length: int) -> int:
        """Estimated per-device bytes of the activations a training step
        saves for its backward pass (`memory.activation_bytes_per_device`)."""
        return memory.activation_bytes_per_device(self, batch_size, sequence_length)

    def compiled_memory(
        self, batch_size: int, sequence_length: int, optimizer="adam", **options
    ):
        """XLA's per-device bytes of this plan's training step, compiled ahead
        of time with no weight allocated (`model_class=`, `preset=`,
        `device_mesh=`: see `keras_hub_autodist.compiled_memory`).

        Example:
        ```python
        plan.compiled_memory(8, 2048, "adam").peak_bytes
        ```
        """
        from keras_hub_autodist.compiled_memory import compiled_memory

        return compiled_memory(self, batch_size, sequence_length, optimizer, **options)

    @property
    def fits(self) -> bool:
        """Whether weights, gradients and Adam state fit each device.

        Activations come on top: `strategy="auto"` keeps `"tp"` only while
        this leaves room for them (`policy.leaves_room_for_activations`).
        """
        return self.training_bytes_per_device("adam") <= self.device_memory_bytes

    @property
    def fallbacks(self) -> list[Weight]:
        """The rows whose preferred layout could not be used."""
        return [row for row in self.rows if row.note]

    def layout_map(self, device_mesh=None) -> keras.distribution.LayoutMap:
        """A `keras.distribution.LayoutMap` for this plan on `device_mesh`.

        Keys are anchored for `re.fullmatch`; every kernel also gets keys for
        the `lora_kernel_a`/`lora_kernel_b` that `enable_lora()` creates,
        laid out consistently with the kernel.

        Args:
            device_mesh: a `keras.distribution.DeviceMesh` with the planned
                axis names and shape (a plan holds the mesh's shape, not its
                devices).
        """
        import keras

        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise MeshError(
                "`layout_map()` needs a `keras.distribution.DeviceMesh`: a "
                "plan holds the mesh's axis names and sizes, not its devices. "
                "Pass `plan.layout_map(keras.distribution.DeviceMesh(shape, "
                "axis_names, devices))`. Received: "
                f"device_mesh={device_mesh!r}"
            )
        got = (tuple(device_mesh.axis_names), tuple(device_mesh.shape))
        want = (self.mesh_axes.axis_names, self.mesh_axes.shape)
        if got != want:
            raise MeshError(
                f"The mesh does not match the plan: planned axes {want[0]} "
                f"with shape {want[1]}. Re-plan for this mesh or pass the "
                f"planned one. Received: axes {got[0]} with shape {got[1]}"
            )
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layouts = self.weight_layouts()
        activations = self.activation_layouts()
        self._check_activation_keys(layouts, activations)
        for pattern, spec in {**layouts, **activations}.items():
            layout_map[pattern] = spec
        return layout_map

    def _check_activation_keys(self, layouts, activations) -> None:
        """Layer-output keys and weight keys share one `LayoutMap`, whose
        keys are regexes matched against variable paths and layer-output
        paths alike: no key of one kind may match a path of the other."""
        weight_paths = [row.path for row in self.rows]
        weight_paths += [
            path.rsplit("/", 1)[0] + suffix
            for path in weight_paths
            if path.endswith("/kernel")
            for suffix in ("/lora_kernel_a", "/lora_kernel_b")
        ]
        for key in activations:
            hits = [path for path in weight_paths if re.fullmatch(key, path)]
            if not key.endswith("/output") or hits:
                raise PlanError(
                    f"The activation key {key!r} must match layer "
                    "outputs (`<layer path>/output`) only, but it matches "
                    f"weight paths {hits[:3]}. Fix the {self.architecture!r} "
                    "architecture's `sequence_parallel_outputs`. Received: "
                    f"key={key!r}"
                )
        # The output of the layer that owns each weight.
        output_paths = {path.rsplit("/", 1)[0] + "/output" for path in weight_paths}
        for key in layouts:
            hits = sorted(p for p in output_paths if re.fullmatch(key, p))
            if hits:
                raise PlanError(
                    f"The weight key {key!r} matches layer outputs {hits[:3]}, "
                    "where Keras would apply it to activations. The "
                    f"{self.architecture!r} architecture must anchor its weight "
                    f"patterns. Received: key={key!r}"
                )

    def weight_layouts(self) -> dict[str, tuple]:
        """Layout-map key → layout: one key per rule, or one per weight for
        a rule whose weights got different layouts (e.g. layers of
        different shapes under one rule)."""
        by_pattern: dict[str, list[Weight]] = {}
        for row in self.rows:
            by_pattern.setdefault(row.pattern, []).append(row)
        keyed = []
        for pattern, rows in by_pattern.items():
            if len({row.spec for row in rows}) == 1:
                keyed.append((pattern, rows[0]))
            else:
                keyed.extend((re.escape(row.path), row) for row in rows)
        layouts = {key: row.spec for key, row in keyed}
        for key, row in keyed:
            if row.path.endswith("/kernel") and len(row.spec) >= 2:
                base = key[: -len("kernel")]
                layouts.setdefault(base + "lora_kernel_a", row.spec[:-1] + (None,))
                layouts.setdefault(base + "lora_kernel_b", (None, row.spec[-1]))
        return layouts

    def weight_check(self, *, strict: bool = True) -> WeightCheck:
        """A `verify.WeightCheck` of built variables against this plan.

        Args:
            strict: whether a weight that matches no rule is an error
                (`True`) or a warning, the weight staying replicated.

        Example:
        ```python
        check = plan.weight_check()
        check.built(model.weights)
        ```
        """
        from keras_hub_autodist.verify import WeightCheck

        return WeightCheck(self, strict=strict)

    def memory_note(self) -> str:
        """Where the per-device memory of this plan comes from."""
        return report.memory_note(self)

    def fit_advice(self) -> list[str]:
        """What would make a plan that does not fit fit, most useful first."""
        return report.fit_advice(self)

    def summary(self) -> str:
        """Per-device totals, one line each, and whether the plan fits."""
        return report.summary(self)

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


def _refuse_assignment(self, name, value):
    raise AttributeError(
        f"A LayoutPlan is a frozen value; use `plan.replace({name}=...)` "
        f"for a changed copy. Received: {name}={value!r}"
    )


def _refuse_deletion(self, name):
    raise AttributeError(f"A LayoutPlan is a frozen value. Received: del {name}")


# The dataclass refuses changes already; these say how to get a changed copy.
LayoutPlan.__setattr__ = _refuse_assignment
LayoutPlan.__delattr__ = _refuse_deletion
