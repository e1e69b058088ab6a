"""`PlanRecord`: what a layout plan holds, as values.

The rows (one `Weight` each, with its spec), the mesh's axis names, sizes
and roles (`MeshAxes`, never a live `DeviceMesh`), the strategy and the
reasons behind each choice, and what follows from them alone: byte totals,
the layout-map keys and `layout_map(mesh)`. The memory, text and checks
computed from a plan take a `PlanRecord`; the fitting stage's
`layout_plan.LayoutPlan`, what `plan()` returns, is a `PlanRecord` that
offers them as methods.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.mesh import MeshAxes
from keras_hub_autodist.planning.mesh import require_device_mesh

if TYPE_CHECKING:
    import keras

# Where the per-device memory a plan records comes from: given, the
# environment, reported by the devices, or assumed (the fitting stage's
# `device_memory.device_memory_info` finds it).
MEMORY_GIVEN, MEMORY_ENV, MEMORY_REPORTED, MEMORY_ASSUMED = (
    "given",
    "env",
    "reported",
    "assumed",
)


@dataclasses.dataclass(frozen=True)
class PlanRecord:
    """The values of a layout plan (see `LayoutPlan` for each field).

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    isinstance(plan, PlanRecord)  # True
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
    device_memory_source: str = MEMORY_GIVEN
    mesh_reason: str = ""
    config_fields: Mapping[str, str] = dataclasses.field(
        default_factory=dict, hash=False
    )
    context_parallel_strategy: str = "all_gather"
    sequence_parallel: bool = False
    sequence_parallel_outputs: tuple[str, ...] = ()
    lora_rank: int | None = None
    device_name: str = ""
    remat: Any = dataclasses.field(default=None, hash=False)
    final_logit_soft_cap: float | None = None
    mixed_policy: str = ""

    def __post_init__(self):
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(
            self, "config_fields", types.MappingProxyType(dict(self.config_fields))
        )
        object.__setattr__(
            self, "sequence_parallel_outputs", tuple(self.sequence_parallel_outputs)
        )

    def replace(self, **changes) -> PlanRecord:
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

        - `(batch axis, context axis, None)` when the mesh has a context
          axis of more than one device (context parallelism); the outputs
          of the key and value projections are then also pinned to each
          device's block of tokens (`sharding.key_value_block_spec`), which
          attention gathers;
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
        spec = sharding.context_activation_spec(self.mesh_axes)
        if spec is not None:
            return {
                **{pattern: spec for pattern in self.sequence_parallel_outputs},
                **self._key_value_block_layouts(),
            }
        if self.sequence_parallel:
            spec = sharding.sequence_parallel_spec(self.mesh_axes)
        if spec is None and self.strategy == "fsdp":
            spec = sharding.fsdp_activation_spec(self.mesh_axes)
        if spec is None:
            return {}
        return {pattern: spec for pattern in self.sequence_parallel_outputs}

    def _key_value_block_layouts(self) -> dict[str, tuple]:
        """`<key/value layer>/output` → its block layout, keyed as the
        layer's kernel is (`_weight_keys`): an output's layout follows from
        its kernel's alone."""
        return {
            key[: -len("kernel")] + "output": sharding.key_value_block_spec(
                row, self.mesh_axes
            )
            for key, row in self._weight_keys()
            if "kv_heads" in row.logical_axes and row.path.endswith("/kernel")
        }

    @property
    def context_axis(self) -> str | None:
        """The mesh axis that splits each sequence, or `None`."""
        return self.mesh_axes.context_axis

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

        require_device_mesh(
            device_mesh,
            "`layout_map()` needs a `keras.distribution.DeviceMesh`: a plan "
            "holds the mesh's axis names and sizes, not its devices. Pass "
            "`plan.layout_map(keras.distribution.DeviceMesh(shape, "
            "axis_names, devices))`.",
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

    def _weight_keys(self) -> list[tuple[str, Weight]]:
        """`(layout-map key, a row it covers)`: one key per rule, or one per
        weight for a rule whose weights got different layouts (e.g. layers
        of different shapes under one rule)."""
        by_pattern: dict[str, list[Weight]] = {}
        for row in self.rows:
            by_pattern.setdefault(row.pattern, []).append(row)
        keyed = []
        for pattern, rows in by_pattern.items():
            if len({row.spec for row in rows}) == 1:
                keyed.append((pattern, rows[0]))
            else:
                keyed.extend((re.escape(row.path), row) for row in rows)
        return keyed

    def weight_layouts(self) -> dict[str, tuple]:
        """Layout-map key → layout (`_weight_keys`), with keys for the LoRA
        kernels `enable_lora()` creates beside each kernel."""
        keyed = self._weight_keys()
        layouts = {key: row.spec for key, row in keyed}
        for key, row in keyed:
            if row.path.endswith("/kernel") and len(row.spec) >= 2:
                base = key[: -len("kernel")]
                layouts.setdefault(base + "lora_kernel_a", row.spec[:-1] + (None,))
                layouts.setdefault(base + "lora_kernel_b", (None, row.spec[-1]))
        return layouts


def _refuse_assignment(self, name, value):
    raise AttributeError(
        f"A LayoutPlan is a frozen value; use `plan.replace({name}=...)` "
        f"for a changed copy. Received: {name}={value!r}"
    )


def _refuse_deletion(self, name):
    raise AttributeError(f"A LayoutPlan is a frozen value. Received: del {name}")


# The dataclass refuses changes already; these say how to get a changed copy.
PlanRecord.__setattr__ = _refuse_assignment
PlanRecord.__delattr__ = _refuse_deletion
