"""`LayoutPlan`: where every weight of a model goes on a mesh, and its cost.

Planning a local preset folder for a mesh given as a mapping imports neither
Keras, keras-hub nor JAX: the config is read by `presets.read_local_config`
and the handler found by class name. Keras is imported only where a Keras
object is needed (`layout_map()`, `DeviceMesh`s) or the preset needs
keras-hub's loaders (handles, built-in names, other formats).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import sys
import types
import warnings
from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from keras_hub_autodist import rules
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import UnplannedWeightWarning
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.errors import WeightShapeError
from keras_hub_autodist.errors import option
from keras_hub_autodist.mesh import MeshAxes
from keras_hub_autodist.mesh import is_device_mesh
from keras_hub_autodist.mesh import resolve_mesh_axes
from keras_hub_autodist.presets import PresetConfig
from keras_hub_autodist.presets import read_config_dict
from keras_hub_autodist.presets import read_local_config
from keras_hub_autodist.presets import read_local_config_dict
from keras_hub_autodist.presets import read_preset_config
from keras_hub_autodist.presets import validate_config
from keras_hub_autodist.presets import validated_weights
from keras_hub_autodist.presets import variable_dtype
from keras_hub_autodist.registry import DOCS_ADDING_AN_ARCHITECTURE
from keras_hub_autodist.registry import handler_by_name
from keras_hub_autodist.registry import handler_for

if TYPE_CHECKING:
    import keras

STRATEGY_CHOICES = ("auto",) + rules.STRATEGIES
DEVICE_MEMORY_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB"
# Bytes per parameter while training with Adam: the weight, its gradient and
# the two moments, all in the variable dtype.
ADAM_STATE_FACTOR = 4
GIB = 1024**3
ITEMSIZES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# Where the per-device memory of a plan comes from (`LayoutPlan.device_memory_source`).
MEMORY_GIVEN, MEMORY_ENV, MEMORY_REPORTED, MEMORY_ASSUMED = (
    "given",
    "env",
    "reported",
    "assumed",
)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """The layout of one weight.

    Args:
        path: the variable path.
        pattern: the layout-map key (a regex for `re.fullmatch`).
        shape: the weight's shape.
        logical_axes: the logical axis of each dimension.
        spec: the mesh axis (or `None`) of each dimension.
        dtype: the variable dtype.
        bytes: the weight's total size in bytes.
        device_bytes: the bytes each device holds.
        fallbacks: the `rules.Fallback`s taken (weight, dimension, wanted
            axis, chosen axis, reason); `note` is their text.
    """

    path: str
    pattern: str
    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    spec: tuple[str | None, ...]
    dtype: str
    bytes: int
    device_bytes: int
    fallbacks: tuple[rules.Fallback, ...] = ()

    @property
    def note(self) -> str:
        """The fallbacks as text, with their reasons (`""` if none)."""
        return "; ".join(str(fallback) for fallback in self.fallbacks)


class LayoutPlan:
    """How a model's weights are laid out on a mesh, computed from its config.

    Build one with `keras_hub_autodist.plan()`.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    print(plan)                      # table of weights, specs and bytes
    plan.max_device_bytes            # parameter bytes on the fullest device
    layout_map = plan.layout_map(mesh)  # for your own ModelParallel
    ```
    """

    def __init__(
        self,
        *,
        preset: str,
        backbone_class: str,
        architecture: str,
        mesh_axes: MeshAxes,
        strategy: str,
        strategy_reason: str,
        dtype: str,
        rows: Iterable[PlanRow],
        device_memory_bytes: int,
        device_mesh=None,
        device_memory_source: str = MEMORY_GIVEN,
        mesh_reason: str = "",
        config_fields: Mapping[str, str] | None = None,
        sequence_parallel: bool = False,
        sequence_parallel_outputs: Iterable[str] = (),
    ):
        values = dict(
            preset=preset,
            backbone_class=backbone_class,
            architecture=architecture,
            mesh_axes=mesh_axes,
            strategy=strategy,
            strategy_reason=strategy_reason,
            dtype=dtype,
            rows=tuple(rows),
            device_memory_bytes=device_memory_bytes,
            device_mesh=device_mesh,
            device_memory_source=device_memory_source,
            mesh_reason=mesh_reason,
            # Logical axis -> the config field that sets it, for messages.
            config_fields=types.MappingProxyType(dict(config_fields or {})),
            _sequence_parallel=bool(sequence_parallel),
            _sequence_parallel_outputs=tuple(sequence_parallel_outputs),
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(
            f"A LayoutPlan is a frozen value; use `plan.replace({name}=...)` "
            f"for a changed copy. Received: {name}={value!r}"
        )

    def __delattr__(self, name):
        raise AttributeError(f"A LayoutPlan is a frozen value. Received: del {name}")

    def replace(self, **changes) -> LayoutPlan:
        """A copy of this plan with some fields changed.

        Example:
        ```python
        plan.replace(mesh_reason="chosen by hand")
        ```
        """
        fields = dict(
            preset=self.preset,
            backbone_class=self.backbone_class,
            architecture=self.architecture,
            mesh_axes=self.mesh_axes,
            strategy=self.strategy,
            strategy_reason=self.strategy_reason,
            dtype=self.dtype,
            rows=self.rows,
            device_memory_bytes=self.device_memory_bytes,
            device_mesh=self.device_mesh,
            device_memory_source=self.device_memory_source,
            mesh_reason=self.mesh_reason,
            config_fields=self.config_fields,
            sequence_parallel=self._sequence_parallel,
            sequence_parallel_outputs=self._sequence_parallel_outputs,
        )
        unknown = set(changes) - set(fields)
        if unknown:
            raise PlanError(
                f"A LayoutPlan has no field {sorted(unknown)}; use one of "
                f"{sorted(fields)}. Received: {sorted(changes)}"
            )
        return LayoutPlan(**{**fields, **changes})

    @property
    def sequence_parallel(self) -> bool:
        """Whether residual-stream activations are sharded on the sequence
        over the model axis (set by `plan(..., sequence_parallel=True)`)."""
        return self._sequence_parallel

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
        spec = self._sequence_parallel_spec() or self._fsdp_activation_spec()
        if spec is None:
            return {}
        return {pattern: spec for pattern in self._sequence_parallel_outputs}

    def _sequence_parallel_spec(self) -> tuple | None:
        if not self._sequence_parallel:
            return None
        return rules.sequence_parallel_spec(self.mesh_axes)

    def _fsdp_activation_spec(self) -> tuple | None:
        if self.strategy != "fsdp":
            return None
        return rules.fsdp_activation_spec(self.mesh_axes)

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
        """Estimated per-device bytes of weights + gradients + optimizer state.

        Activations are not included.

        Args:
            optimizer: `"adam"` (two moments), `"sgd"` (none) or
                `"sgd_momentum"` (one).
        """
        factors = {"adam": ADAM_STATE_FACTOR, "sgd": 2, "sgd_momentum": 3}
        if optimizer not in factors:
            raise PlanError(
                f"Unknown optimizer for the memory estimate. Use one of "
                f"{sorted(factors)}. Received: optimizer={optimizer!r}"
            )
        return factors[optimizer] * self.max_device_bytes

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

        Activations come on top: strategy `"auto"` keeps `"tp"` only while
        this takes at most `rules.AUTO_TP_MEMORY_SHARE` of the memory.
        """
        return self.training_bytes_per_device("adam") <= self.device_memory_bytes

    def activation_bytes_per_device(self, batch_size: int, sequence_length: int) -> int:
        """Estimated per-device bytes of the activations a training step
        saves for its backward pass.

        Counted in the plan's dtype, for a decoder of `L` blocks with hidden
        size `d`, `H` query and `K` key/value heads of size `h`, gated MLP
        width `F`, vocabulary `V`, on
        `b = batch_size / size of the batch axis` sequences of `s` tokens:

        - per block: `4·b·s·d` (block input, attention-norm output, residual
          after attention, MLP-norm output), `b·s·(2H + 2K)·h` (query, key,
          value, attention context), `2·b·H·s²` (attention scores and their
          softmax), `2·b·s·F` per up-projection of width `F` (its output,
          and the activation or gated product), times `E` for a mixture of
          `E` experts (keras-hub runs every expert on every token), plus
          `E·b·s·d` for the experts' outputs before the weighted sum;
        - after the blocks: `2·b·s·d` (final norm in and out) and `3·b·s·V`
          (logits, their softmax and their gradient).

        Each term is divided by the shards the plan gives it on the model
        axes: head terms by those of the query (or key/value) kernel's head
        dimensions, MLP terms by those of each up-projection's `mlp` and
        `expert` dimensions, logits by those of the output embedding's vocabulary;
        the residual stream is replicated over the model axis, or split over
        it with `sequence_parallel`. Gradients
        and optimizer state are not included (`training_bytes_per_device`).

        Args:
            batch_size: the global batch size, split over the batch axis.
            sequence_length: tokens per sequence.

        Example:
        ```python
        plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
        plan.activation_bytes_per_device(batch_size=8, sequence_length=2048)
        ```
        """
        for name, value in (
            ("batch_size", batch_size),
            ("sequence_length", sequence_length),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(
                    f"`{name}` must be a positive integer for the activation "
                    f"estimate. Received: {name}={value!r}"
                )
        parallel = {"vocab", "heads", "kv_heads", "head_dim", "mlp", "expert"}

        def dim(row, logical):
            return row.shape[row.logical_axes.index(logical)]

        def model_shards(row, logicals=parallel):
            """Shards of a row's `logicals` dimensions on non-batch axes."""
            return math.prod(
                self.mesh_axes.size(axis)
                for axis, logical in zip(row.spec, row.logical_axes)
                if axis and axis != self.batch_axis and logical in logicals
            )

        def first(condition):
            return next((r for r in self.rows if condition(r)), None)

        query = first(lambda r: "query" in r.path and "heads" in r.logical_axes)
        key = first(lambda r: "kv_heads" in r.logical_axes)
        # Up-projections (hidden → MLP width), of dense MLPs and of experts.
        ups = [r for r in self.rows if r.logical_axes[-2:] == ("embed", "mlp")]
        downs = [r for r in self.rows if r.logical_axes[-2:] == ("mlp", "embed")]
        vocab = [r for r in self.rows if "vocab" in r.logical_axes]
        if query is None or not ups or not vocab:
            raise PlanError(
                "The activation estimate needs a decoder's query, MLP and "
                f"embedding weights; the {self.architecture!r} plan lacks one. "
                f"Received: architecture={self.architecture!r}"
            )
        # The output projection: the untied reverse embedding if any.
        output = vocab[-1]
        layers = sum(1 for r in self.rows if r.pattern == query.pattern)
        b = batch_size / self.mesh_axes.size(self.batch_axis)
        s = sequence_length
        d = dim(output, "embed")
        h = dim(query, "head_dim")
        heads = dim(query, "heads")
        kv_heads = dim(key, "kv_heads") if key is not None else heads

        def experts(row):
            return dim(row, "expert") if "expert" in row.logical_axes else 1

        q_shards = model_shards(query)
        kv_shards = model_shards(key) if key is not None else q_shards
        # Scores split only where the heads are (head_dim is contracted).
        score_shards = model_shards(query, {"heads"})
        # The residual stream: split on the sequence with sequence parallelism.
        split = (
            self.mesh_axes.size(self.mesh_axes.model_axis)
            if self._sequence_parallel_spec()
            else 1
        )
        stream = b * s * d / split
        block = (
            4 * stream
            + 2 * b * s * heads * h / q_shards
            + 2 * b * s * kv_heads * h / kv_shards
            + 2 * b * heads * s * s / score_shards
        )
        # Each up-projection's output and its activation or gated product,
        # for every expert (keras-hub runs each expert on every token), and
        # each expert's output before the routing-weighted sum.
        mlp = sum(
            2 * b * s * dim(r, "mlp") * experts(r) / model_shards(r) for r in ups
        ) + sum(
            b * s * d * experts(r) / model_shards(r, {"expert"})
            for r in downs
            if "expert" in r.logical_axes
        )
        head = 2 * stream + 3 * b * s * dim(output, "vocab") / model_shards(output)
        return int((layers * block + mlp + head) * _itemsize(self.dtype))

    @property
    def fallbacks(self) -> list[PlanRow]:
        """The rows whose preferred layout could not be used."""
        return [row for row in self.rows if row.note]

    def layout_map(self, device_mesh=None) -> keras.distribution.LayoutMap:
        """A `keras.distribution.LayoutMap` for this plan.

        Keys are anchored for `re.fullmatch`; every kernel also gets keys for
        the `lora_kernel_a`/`lora_kernel_b` that `enable_lora()` creates,
        laid out consistently with the kernel.

        Args:
            device_mesh: a `keras.distribution.DeviceMesh` with the planned
                axes. Required when the plan was made from a mapping.
        """
        import keras

        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if not isinstance(mesh, keras.distribution.DeviceMesh):
            raise MeshError(
                "`layout_map()` needs a `keras.distribution.DeviceMesh`: this "
                "plan was made for a mesh given by axis sizes. Pass "
                "`plan.layout_map(keras.distribution.DeviceMesh(shape, "
                "axis_names, devices))`. Received: "
                f"device_mesh={device_mesh!r}"
            )
        got = (tuple(mesh.axis_names), tuple(mesh.shape))
        want = (self.mesh_axes.axis_names, self.mesh_axes.shape)
        if got != want:
            raise MeshError(
                f"The mesh does not match the plan: planned axes {want[0]} "
                f"with shape {want[1]}. Re-plan for this mesh or pass the "
                f"planned one. Received: axes {got[0]} with shape {got[1]}"
            )
        layout_map = keras.distribution.LayoutMap(mesh)
        layouts = self._layouts()
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
                    "handler's `sequence_parallel_outputs`. Received: "
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
                    f"{self.architecture!r} handler must anchor its weight "
                    f"patterns. Received: key={key!r}"
                )

    def _layouts(self) -> dict[str, tuple]:
        """Layout-map key → layout: one key per rule, or one per weight for
        a rule whose weights got different layouts (e.g. layers of
        different shapes under one rule)."""
        by_pattern: dict[str, list[PlanRow]] = {}
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
        if self.device_memory_source == MEMORY_REPORTED:
            return "reported by the devices"
        if self.device_memory_source == MEMORY_ENV:
            return f"from ${DEVICE_MEMORY_ENV}"
        if self.device_memory_source == MEMORY_ASSUMED:
            return (
                "assumed: no device reported its memory; give yours with "
                f"{option('device_memory')}"
            )
        return "given"

    def fit_advice(self) -> list[str]:
        """What would make a plan that does not fit fit, most useful first."""
        need = self.training_bytes_per_device("adam")
        ratio = need / max(1, self.device_memory_bytes)
        model = self.mesh_axes.model_axis or "model"
        advice = [
            f"put about {math.ceil(ratio)}x as many devices on the '{model}' axis"
        ]
        if self.strategy != "fsdp" and self.mesh_axes.size(self.batch_axis) > 1:
            advice.append(
                f"use {option('strategy', repr('fsdp'))} to shard weights and "
                f"optimizer state over '{self.batch_axis}' too"
            )
        if self.dtype in ("float32", "float64"):
            advice.append(
                f"load with {option('dtype', repr('bfloat16'))} to halve every byte"
            )
        if self.device_memory_source == MEMORY_ASSUMED:
            advice.append(
                f"if your devices have more than "
                f"{_format_bytes(self.device_memory_bytes)}, say so with "
                f"{option('device_memory')}"
            )
        advice.append(
            "check this estimate against the compiled step: "
            "`plan.compiled_memory(batch_size, sequence_length)` (`plan ... "
            "--batch B --seq S --compiled` on the command line)"
        )
        return advice

    def summary(self) -> str:
        """Per-device totals, one line each, and whether the plan fits."""
        size = _format_bytes
        axes = self.mesh_axes
        mesh_reason = f"; {self.mesh_reason}" if self.mesh_reason else ""
        training = self.training_bytes_per_device()
        lines = [
            f"preset: {self.preset} ({self.backbone_class}, {self.architecture})",
            f"mesh: {axes.describe()} (batch axis: {axes.batch_axis}, model "
            f"axis: {axes.model_axis}, hidden axis: {axes.hidden_axis}"
            + (f", expert axis: {axes.expert_axis}" if axes.expert_axis else "")
            + f"{mesh_reason})",
            f"strategy: {self.strategy} ({self.strategy_reason})",
            f"sequence parallel: {self._sequence_parallel_note()}",
            f"parameters: {self.num_parameters:,} ({self.dtype}), "
            f"{size(self.total_bytes)} in all",
            f"per device: {size(self.max_device_bytes)} of parameters (ideal "
            f"{size(self.ideal_device_bytes)}), about {size(training)} to "
            f"train with Adam, of {size(self.device_memory_bytes)} "
            f"({self.memory_note()})",
            f"fallbacks: {len(self.fallbacks)} weights in "
            f"{len({row.pattern for row in self.fallbacks})} rows of the table",
        ]
        share = training / max(1, self.device_memory_bytes)
        if self.fits:
            tight = (
                ", which leaves little room for activations"
                if share > rules.AUTO_TP_MEMORY_SHARE
                else ", before activations"
            )
            lines.append(
                f"fits: yes, weights+grads+Adam take {share:.0%} of each "
                f"device's memory{tight}"
            )
        else:
            where = (
                "even the parameters alone do not fit; "
                if self.max_device_bytes > self.device_memory_bytes
                else "the parameters alone fit (inference), training does not; "
            )
            lines.append(
                f"fits: NO, training with Adam needs {size(training)} per "
                f"device, {share:.1f}x "
                f"the {size(self.device_memory_bytes)} available; {where}to "
                "fit: " + "; or ".join(self.fit_advice())
            )
        return "\n".join(lines)

    def _sequence_parallel_note(self) -> str:
        if not self._sequence_parallel:
            return "off"
        spec = self._sequence_parallel_spec()
        if spec is None:
            return (
                f"on, but the model axis ({self.mesh_axes.model_axis}) has one "
                "device: activations stay as they are"
            )
        return (
            f"on: {len(self._sequence_parallel_outputs)} residual-stream layer "
            f"outputs sharded {spec} on [batch, sequence, hidden]"
        )

    def table_groups(self) -> dict[tuple, list[PlanRow]]:
        """The rows as `table()` shows them: the same weight of every layer
        (`decoder_block_*/...`) with one shape, spec and note in one group.
        Keyed by `(name, shape, spec, note)`."""
        groups: dict[tuple, list[PlanRow]] = {}
        for row in self.rows:
            name = re.sub(r"_\d+(?=/)", "_*", row.path)
            groups.setdefault((name, row.shape, row.spec, row.note), []).append(row)
        return groups

    def table(self) -> str:
        """The weights grouped across layers (`decoder_block_*/...`), with
        shape, spec, bytes and notes."""
        groups = self.table_groups()
        header = ("weight", "count", "shape", "spec", "per device", "note")
        body = []
        for (name, *_), rows in groups.items():
            row = rows[0]
            body.append(
                (
                    name,
                    str(len(rows)),
                    str(row.shape),
                    str(row.spec),
                    _format_bytes(row.device_bytes),
                    row.note,
                )
            )
        widths = [max(len(r[i]) for r in [header] + body) for i in range(5)]
        lines = []
        for r in [header] + body:
            cells = [r[i].ljust(widths[i]) for i in range(5)] + [r[5]]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self):
        return self.table() + "\n\n" + self.summary()

    def __repr__(self):
        return (
            f"<LayoutPlan preset={self.preset!r} backbone={self.backbone_class} "
            f"mesh=({self.mesh_axes.describe()}) strategy={self.strategy!r} "
            f"max_device_bytes={self.max_device_bytes}>"
        )


class WeightCheck:
    """Checks a built model's variables against a plan's layout-map keys.

    Every weight must match exactly one key of `plan.layout_map()` (the
    rules), as Keras' `LayoutMap` matches them: an exact key first, else the
    keys that `re.fullmatch` the path. A weight that no key matches would be
    replicated silently by `ModelParallel`; one that matches several makes
    Keras fail. A weight planned by path must be built with the planned
    shape.

    Build one with `LayoutPlan.weight_check()`.

    Args:
        plan: the `LayoutPlan`.
        strict: whether unmatched weights are an error (`True`) or a
            warning, the weights staying replicated (`False`).

    Example:
    ```python
    check = plan.weight_check(strict=False)
    check.created("decoder_block_0/attention/query/kernel", (8, 2048, 256))
    check.built(backbone.weights)  # warns for unplanned weights
    ```
    """

    def __init__(self, plan: LayoutPlan, *, strict: bool = True):
        if not isinstance(strict, bool):
            raise PlanError(
                "`strict` is True (a weight that no layout rule matches is an "
                "error) or False (a warning; the weight stays replicated). "
                f"Received: strict={strict!r}"
            )
        self.plan = plan
        self.strict = strict
        self._keys = list(plan._layouts())
        self._key_set = set(self._keys)
        self._compiled = [re.compile(key) for key in self._keys]
        self._rows = {row.path: row for row in plan.rows}
        # Layout key -> the planned rows it covers, to check weights whose
        # paths differ from the abstract build's (blocks that keras-hub names
        # from a process-wide counter, as in its MoE families).
        self._key_rows: dict[str, list[PlanRow]] = {}
        for row in plan.rows:
            key = row.pattern if row.pattern in self._key_set else re.escape(row.path)
            self._key_rows.setdefault(key, []).append(row)

    def planned_row(self, path: str) -> PlanRow | None:
        """The planned row of `path`: by path, else the rows of its one
        matching key when they all have one shape."""
        row = self._rows.get(path)
        if row is not None:
            return row
        keys = self.matching_keys(path)
        rows = self._key_rows.get(keys[0], []) if len(keys) == 1 else []
        if rows and len({r.shape for r in rows}) == 1:
            return rows[0]
        return None

    def matching_keys(self, path: str) -> list[str]:
        """The layout-map keys that match `path`, as Keras' `LayoutMap`
        matches them: an identical key alone, else every key that
        `re.fullmatch`es it."""
        if path in self._key_set:
            return [path]
        return [k for k, c in zip(self._keys, self._compiled) if c.fullmatch(path)]

    def created(self, path: str, shape: Iterable[int]) -> None:
        """Check one variable as it is created, before it is laid out.

        Raises:
            WeightShapeError: its path is planned with another shape.
            UnplannedWeightError: its path matches several keys.
        """
        shape = tuple(int(size) for size in shape)
        row = self.planned_row(path)
        if row is not None and row.shape != shape:
            raise self._shape_error(row, shape, path)
        keys = self.matching_keys(path)
        if len(keys) > 1:
            raise self._unplanned_error([], {path: keys})

    def built(self, variables: Iterable[Any]) -> list[str]:
        """Check every variable of a built model (objects with `.path` and
        `.shape`, e.g. `model.weights`).

        Returns:
            The paths of the weights that match no key (replicated), when
            `strict=False`.

        Raises:
            WeightShapeError: a planned weight has another shape.
            UnplannedWeightError: a weight matches several keys, or (when
                `strict`) none.
        """
        unmatched, ambiguous = [], {}
        for variable in variables:
            path = variable.path
            shape = tuple(int(size) for size in variable.shape)
            row = self.planned_row(path)
            if row is not None and row.shape != shape:
                raise self._shape_error(row, shape, path)
            keys = self.matching_keys(path)
            if not keys:
                unmatched.append(f"{path} {shape}")
            elif len(keys) > 1:
                ambiguous[path] = keys
        if ambiguous or (unmatched and self.strict):
            raise self._unplanned_error(unmatched, ambiguous)
        if unmatched:
            warnings.warn(
                f"keras_hub_autodist: {len(unmatched)} weights of the "
                f"{self.plan.backbone_class} model match no rule of the "
                f"{self.plan.architecture!r} layout and stay replicated on "
                f"every device (strict=False): {', '.join(unmatched[:10])}",
                UnplannedWeightWarning,
                stacklevel=3,
            )
        return [entry.split(" ")[0] for entry in unmatched]

    def _where(self) -> str:
        return (
            f"the {self.plan.architecture!r} layout of "
            f"{self.plan.backbone_class} (planned from {self.plan.preset})"
        )

    def _unplanned_error(self, unmatched, ambiguous) -> UnplannedWeightError:
        parts = []
        if unmatched:
            parts.append(
                f"{len(unmatched)} weights match no rule of {self._where()}, "
                "so Keras would silently replicate them on every device: "
                + ", ".join(unmatched[:10])
            )
        if ambiguous:
            parts.append(
                f"{len(ambiguous)} weights match several rules of "
                f"{self._where()}, so no single layout applies: "
                + ", ".join(f"{p} (keys {k})" for p, k in list(ambiguous.items())[:5])
            )
        fix = (
            f"Report it to the {self.plan.architecture!r} handler's authors "
            "with the preset's config.json, or give these weights a rule "
            f"(see {DOCS_ADDING_AN_ARCHITECTURE})"
        )
        if unmatched and not ambiguous:
            fix += f", or pass {option('strict', 'False')} to load them replicated"
        received = list(ambiguous) + [u.split(" ")[0] for u in unmatched]
        return UnplannedWeightError(
            f"{'; '.join(parts)}. {fix}. Received: weights {received[:10]}"
        )

    def _shape_error(self, row: PlanRow, shape: tuple, path: str) -> WeightShapeError:
        differs = []
        if len(shape) == len(row.shape):
            for index, (planned, built) in enumerate(zip(row.shape, shape)):
                if planned != built:
                    axis = row.logical_axes[index]
                    field = self.plan.config_fields.get(axis)
                    source = f", set by `{field}`" if field else ""
                    differs.append(
                        f"dimension {index} ({axis}{source}): planned "
                        f"{planned}, built {built}"
                    )
        detail = f" ({'; '.join(differs)})" if differs else ""
        return WeightShapeError(
            f"Weight {path!r} of {self.plan.backbone_class} is built with "
            f"shape {shape}, but the plan, made from the config of "
            f"{self.plan.preset}, gives it {row.shape}{detail}. The model is "
            "being built from another config than the one planned: most "
            "likely the preset's task.json holds a backbone config that "
            "disagrees with its config.json (keras-hub builds a task from "
            "task.json). Make the two agree, e.g. save the model again with "
            "`save_to_preset`. Received: "
            f"built shape {shape}, planned shape {row.shape} for {path!r}"
        )


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _devices_of(device_mesh):
    if not is_device_mesh(device_mesh):
        return []
    import numpy as np

    return list(np.ravel(device_mesh.backend_mesh.devices))


def device_memory_info(devices=(), override=None) -> tuple[int, str]:
    """Per-device memory for strategy `"auto"`, and where it comes from.

    In order: `override` (`"given"`); `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB`
    (`"env"`); the smallest `bytes_limit` that `devices` report
    (`"reported"`); else `rules.DEFAULT_DEVICE_MEMORY_BYTES`, 16 GiB
    (`"assumed"`).

    Args:
        devices: JAX devices to ask (only this process's devices answer).
        override: bytes to use as-is.

    Example:
    >>> device_memory_info([], 8 * 1024**3)
    (8589934592, 'given')
    """
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)):
            raise PlanError(
                "`device_memory` is a number of bytes per device, e.g. "
                f"16 * 1024**3. Received: device_memory={override!r}"
            )
        if not math.isfinite(override) or override <= 0:
            raise PlanError(
                f"{option('device_memory')} must be a positive amount of "
                f"memory per device. Received: device_memory={override!r}"
            )
        return int(override), MEMORY_GIVEN
    from_env = os.environ.get(DEVICE_MEMORY_ENV)
    if from_env:
        try:
            value = float(from_env)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value <= 0:
            raise MeshError(
                f"${DEVICE_MEMORY_ENV} must be a number of GiB above 0, e.g. "
                f"16. Received: {DEVICE_MEMORY_ENV}={from_env!r}"
            )
        return int(value * GIB), MEMORY_ENV
    limits = []
    for device in devices:
        try:
            # Only this process's devices can report (multi-host meshes).
            if device not in device.client.local_devices():
                continue
            stats = device.memory_stats()
        except Exception:  # backends without memory statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(stats["bytes_limit"])
    if limits:
        return min(limits), MEMORY_REPORTED
    return rules.DEFAULT_DEVICE_MEMORY_BYTES, MEMORY_ASSUMED


def device_memory_bytes(device_mesh=None, override: int | None = None) -> int:
    """Per-device memory used by strategy `"auto"` (see `device_memory_info`).

    Args:
        device_mesh: a `DeviceMesh` whose devices to ask, or `None`.
        override: bytes to use as-is.

    Example:
    >>> device_memory_bytes(None, 1024)
    1024
    """
    return device_memory_info(_devices_of(device_mesh), override)[0]


def _itemsize(dtype: str) -> int:
    if dtype in ITEMSIZES:
        return ITEMSIZES[dtype]
    import ml_dtypes
    import numpy as np

    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def _rows_for(weights, mesh_axes, strategy, fields, dtype, kv_fallback):
    itemsize = _itemsize(dtype)
    rows = []
    for weight in weights:
        spec, notes = rules.assign_mesh_axes(
            weight, mesh_axes, strategy, fields, kv_fallback=kv_fallback
        )
        shards = math.prod(mesh_axes.size(axis) for axis in spec if axis)
        size = math.prod(weight.shape) * itemsize
        rows.append(
            PlanRow(
                path=weight.path,
                pattern=weight.pattern,
                shape=weight.shape,
                logical_axes=weight.axes,
                spec=spec,
                dtype=dtype,
                bytes=size,
                device_bytes=size // shards,
                fallbacks=tuple(notes),
            )
        )
    return rows


def _plan_rows(weights, mesh_axes, strategy, fields, dtype, device_memory=None):
    """The rows and why K/V were laid out so, when their heads don't divide.

    When the query heads don't divide the model axis either, K/V follow the
    query's layout: sharded on head_dim when the query is, else replicated.
    Otherwise each of `rules.KV_LAYOUTS` is laid out and
    `rules.choose_kv_layout` takes the one moving the fewest bytes among
    those whose weights, gradients and Adam state fit `device_memory` and
    whose parameters meet the planner's per-device target
    (`rules.TP_DEVICE_BYTES_TARGET` x total / model-axis size for "tp",
    `rules.FSDP_DEVICE_BYTES_TARGET` x total / devices for "fsdp"). The
    reason is derived from the rows as laid out, so it always agrees with
    them.
    """

    def rows_with(kv_fallback):
        return _rows_for(weights, mesh_axes, strategy, fields, dtype, kv_fallback)

    model_axis = mesh_axes.model_axis
    model_size = mesh_axes.size(model_axis)
    heads = [w for w in weights if "heads" in w.axes]
    kv = [w for w in weights if "kv_heads" in w.axes]
    if model_size == 1 or not kv:
        return rows_with("replicate"), ""
    kv_heads = kv[0].shape[kv[0].axes.index("kv_heads")]
    if kv_heads % model_size == 0:
        return rows_with("replicate"), ""
    if heads and heads[0].shape[heads[0].axes.index("heads")] % model_size:
        sharded = rows_with("head_dim")
        query = next(r for r in sharded if r.path == heads[0].path)
        on_head_dim = query.spec[query.logical_axes.index("head_dim")] == model_axis
        if on_head_dim:
            return sharded, "query heads are sharded on head_dim, so are K/V"
        # The query is replicated over the model axis; so are K/V, and their
        # own notes say why.
        return rows_with("replicate"), ""
    capacity = (
        rules.DEFAULT_DEVICE_MEMORY_BYTES if device_memory is None else device_memory
    )
    if strategy == "fsdp":
        target, shards = rules.FSDP_DEVICE_BYTES_TARGET, mesh_axes.num_devices
    else:
        target, shards = rules.TP_DEVICE_BYTES_TARGET, model_size
    laid_out, candidates = {}, []
    for layout in rules.KV_LAYOUTS:
        rows = laid_out[layout.kv_fallback] = rows_with(layout.kv_fallback)
        held = sum(r.device_bytes for r in rows)
        ideal = sum(r.bytes for r in rows) / shards
        candidates.append(
            rules.KVCandidate(layout, ADAM_STATE_FACTOR * held, held / ideal)
        )
    chosen, reason = rules.choose_kv_layout(
        candidates,
        capacity=capacity,
        target=target,
        strategy=strategy,
        axis=model_axis,
    )
    return laid_out[chosen.kv_fallback], reason


def tp_fits(tp_plan: LayoutPlan) -> bool:
    """Whether a `"tp"` plan's weights, gradients and Adam state fit the
    planned device memory with room for activations (the `"auto"` rule)."""
    budget = rules.AUTO_TP_MEMORY_SHARE * tp_plan.device_memory_bytes
    return tp_plan.training_bytes_per_device("adam") <= budget


def _handler_of(preset_config: PresetConfig):
    if preset_config.backbone_cls is not None:
        return handler_for(preset_config.backbone_cls)
    handler = handler_by_name(preset_config.backbone_class)
    if handler is None:
        raise UnsupportedArchitectureError(
            "keras_hub_autodist has no layout for "
            f"{preset_config.backbone_class}. Read the preset with "
            "`read_preset_config` so that its class's base classes are "
            f"searched too. Received: preset={preset_config.preset!r}"
        )
    return handler


def _path_string(path: os.PathLike) -> str:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    # A path object is a folder: spell it as one, never as a preset name.
    if not os.path.isabs(text) and not text.startswith((".", "~")):
        text = os.path.join(os.curdir, text)
    return text


def _instance_config(model) -> PresetConfig:
    """The backbone class and config of a keras-hub backbone or task."""
    keras_hub = sys.modules.get("keras_hub")
    models = getattr(keras_hub, "models", None)
    if models is None or not isinstance(model, (models.Backbone, models.Task)):
        raise PlanInputError(
            "`plan()` and `get_layout_map()` take a preset (a folder path, "
            "`hf://…`, `kaggle://…` or a preset name), a config dict (a "
            "config.json's contents, or {'class_name': 'GemmaBackbone', "
            "'config': backbone.get_config()}) or a keras-hub backbone or "
            f"task instance. Received: preset={model!r} of type "
            f"{type(model).__name__}"
        )
    label = f"<{type(model).__name__} instance>"
    backbone = model
    if isinstance(model, models.Task):
        backbone = getattr(model, "backbone", None)
        if not isinstance(backbone, models.Backbone):
            raise PlanInputError(
                f"This {type(model).__name__} has no keras-hub backbone to "
                "plan; pass the backbone, a preset or a config dict. "
                f"Received: preset={label}, backbone={backbone!r}"
            )
    config = dict(backbone.get_config())
    # Constructor arguments some get_config() forget (keras-hub 0.32's
    # LlamaBackbone drops `tie_word_embeddings`) are read from the instance.
    for name in inspect.signature(type(backbone).__init__).parameters:
        value = getattr(backbone, name, None)
        if name not in config and isinstance(value, (bool, int, float, str)):
            config[name] = value
    return PresetConfig(label, type(backbone), config, "keras")


def read_config(preset) -> PresetConfig:
    """The config to plan, read without keras-hub whenever possible.

    Local folders and config dicts of a family with a handler registered by
    name are read without Keras (`presets.read_local_config`,
    `presets.read_local_config_dict`); anything else goes through
    keras-hub's loaders (`presets.read_preset_config`,
    `presets.read_config_dict`). A backbone (or task) instance gives its
    class and `get_config()`.

    Args:
        preset: as for `plan()`.

    Example:
    ```python
    read_config("./gemma_2b").backbone_class
    ```
    """
    if isinstance(preset, os.PathLike):
        preset = _path_string(preset)
    if isinstance(preset, str):
        info = read_local_config(preset)
        if info is not None and handler_by_name(info.backbone_class) is not None:
            return info
        return read_preset_config(preset)
    if isinstance(preset, Mapping):
        info = read_local_config_dict(preset)
        if info is not None and (
            info.backbone_cls is not None
            or handler_by_name(info.backbone_class) is not None
        ):
            return info
        return read_config_dict(preset)
    return _instance_config(preset)


def plan_config(
    preset_config: PresetConfig,
    device_mesh,
    *,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    dtype=None,
    device_memory: int | None = None,
    sequence_parallel: bool = False,
    strict: bool = True,
) -> LayoutPlan:
    """`plan()` for a config already read with `read_config`.

    Example:
    ```python
    plan_config(read_config("./gemma_2b"), {"batch": 2, "model": 4})
    ```
    """
    if strategy not in STRATEGY_CHOICES:
        raise StrategyError(
            f"Unknown strategy. Use one of {list(STRATEGY_CHOICES)}. "
            f"Received: strategy={strategy!r}"
        )
    if not isinstance(strict, bool):
        raise PlanError(
            "`strict` is True (a weight that no layout rule matches is an "
            "error) or False (a warning; the weight stays replicated). "
            f"Received: strict={strict!r}"
        )
    if not isinstance(sequence_parallel, bool):
        raise StrategyError(
            "`sequence_parallel` is True (shard residual-stream activations "
            "on the sequence over the model axis) or False. Received: "
            f"sequence_parallel={sequence_parallel!r}"
        )
    mesh_axes = resolve_mesh_axes(
        device_mesh, batch_axis=batch_axis, model_axis=model_axis
    )
    handler = _handler_of(preset_config)
    sp_outputs = tuple(getattr(handler, "sequence_parallel_outputs", ()) or ())
    if sequence_parallel and not sp_outputs:
        raise UnsupportedArchitectureError(
            f"keras_hub_autodist has no sequence-parallel layout for the "
            f"{handler.name!r} family ({preset_config.backbone_class}): its "
            "handler lists no `sequence_parallel_outputs`. Load it without "
            "`sequence_parallel=True`. Received: sequence_parallel=True"
        )
    fields = dict(handler.config_fields)
    validate_config(preset_config, [*fields.values(), "num_layers"])
    weights = validated_weights(handler, preset_config, fields, strict=strict)
    var_dtype = variable_dtype(preset_config.config, dtype)
    capacity, source = device_memory_info(_devices_of(device_mesh), device_memory)

    def build(chosen, reason):
        rows, kv_reason = _plan_rows(
            weights, mesh_axes, chosen, fields, var_dtype, capacity
        )
        if kv_reason:
            rows = [
                dataclasses.replace(
                    r,
                    fallbacks=tuple(
                        dataclasses.replace(f, policy=kv_reason)
                        if f.wanted == "kv_heads"
                        else f
                        for f in r.fallbacks
                    ),
                )
                if r.fallbacks and "kv_heads" in r.logical_axes
                else r
                for r in rows
            ]
        return LayoutPlan(
            preset=str(preset_config.preset),
            backbone_class=preset_config.backbone_class,
            architecture=handler.name,
            mesh_axes=mesh_axes,
            strategy=chosen,
            strategy_reason=reason,
            dtype=var_dtype,
            rows=rows,
            device_memory_bytes=capacity,
            device_mesh=device_mesh if is_device_mesh(device_mesh) else None,
            device_memory_source=source,
            config_fields=fields,
            sequence_parallel=sequence_parallel,
            sequence_parallel_outputs=sp_outputs,
        )

    if strategy != "auto":
        return build(strategy, "requested")
    tp = build("tp", "")
    need = tp.training_bytes_per_device("adam")
    budget = f"{rules.AUTO_TP_MEMORY_SHARE:.0%} of {capacity / GIB:.1f} GiB ({source})"
    if tp_fits(tp):
        return tp.replace(
            strategy_reason=f"auto: weights+grads+Adam {need / GIB:.2f} GiB per "
            f"device fit in {budget}"
        )
    if mesh_axes.size(mesh_axes.batch_axis) == 1:
        return tp.replace(
            strategy_reason=f"auto: weights+grads+Adam need {need / GIB:.2f} GiB "
            f"per device, over {budget}; fsdp would shard nothing more on a "
            "batch axis of size 1"
        )
    return build(
        "fsdp",
        f"auto: with tp, weights+grads+Adam need {need / GIB:.2f} GiB per "
        f"device, over {budget}",
    )


def auto_mesh(
    preset_config: PresetConfig,
    num_devices: int,
    *,
    dtype=None,
    device_memory: int | None = None,
    devices=(),
) -> tuple[dict[str, int], str]:
    """The mesh `device_mesh="auto"` picks over `num_devices` devices.

    The rule: the largest batch axis (the least tensor parallelism) whose
    `"tp"` plan's weights, gradients and Adam state fit in
    `rules.AUTO_TP_MEMORY_SHARE` of a device's memory; if none does, every
    device on the model axis.

    Args:
        preset_config: the config read with `read_config`.
        num_devices: how many devices the mesh spans.
        dtype: as for `plan()`.
        device_memory: as for `plan()`.
        devices: JAX devices to ask for their memory, if any.

    Returns:
        `(mesh, reason)`: axis sizes such as `{"batch": 2, "model": 4}`, and
        a sentence explaining them.

    Example:
    ```python
    auto_mesh(read_config("./gemma_2b"), 8)
    ```
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int):
        raise MeshError(
            "The number of devices is a positive integer. Received: "
            f"devices={num_devices!r}"
        )
    if num_devices < 1:
        raise MeshError(
            f"The number of devices is a positive integer; pass "
            f"{option('devices')}. Received: devices={num_devices!r}"
        )
    capacity, source = device_memory_info(list(devices), device_memory)
    for batch in sorted(
        (d for d in range(1, num_devices + 1) if num_devices % d == 0), reverse=True
    ):
        candidate = {"batch": batch, "model": num_devices // batch}
        tp = plan_config(
            preset_config,
            candidate,
            strategy="tp",
            dtype=dtype,
            device_memory=capacity,
        )
        if tp_fits(tp):
            return candidate, (
                f"auto over {num_devices} devices: the largest batch axis "
                f"whose tp plan fits {rules.AUTO_TP_MEMORY_SHARE:.0%} of "
                f"{capacity / GIB:.1f} GiB ({source})"
            )
    return {"batch": 1, "model": num_devices}, (
        f"auto over {num_devices} devices: no tp plan fits "
        f"{rules.AUTO_TP_MEMORY_SHARE:.0%} of {capacity / GIB:.1f} GiB "
        f"({source}), so every device is on the model axis"
    )


def resolve_auto_mesh(
    preset_config: PresetConfig,
    device_mesh: str,
    *,
    dtype=None,
    device_memory: int | None = None,
) -> tuple[dict[str, int], str, int]:
    """Turn `device_mesh="auto"` into axis sizes over all of JAX's devices.

    Shared by `plan()` and `from_preset`; any other string is a `MeshError`.

    Returns:
        `(mesh, reason, device_memory)`: the axis sizes `auto_mesh` picks,
        its reason, and the per-device memory it planned with.

    Example:
    ```python
    resolve_auto_mesh(read_config("./gemma_2b"), "auto")
    ```
    """
    if device_mesh != "auto":
        raise MeshError(
            "`device_mesh` takes a DeviceMesh, a mapping such as "
            "{'batch': 2, 'model': 4}, or 'auto'. Received: "
            f"device_mesh={device_mesh!r}"
        )
    import jax

    devices = jax.devices()
    mesh, reason = auto_mesh(
        preset_config,
        len(devices),
        dtype=dtype,
        device_memory=device_memory,
        devices=devices,
    )
    if device_memory is None:
        device_memory = device_memory_info(devices)[0]
    return mesh, reason, device_memory


def plan(
    preset,
    device_mesh,
    *,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    dtype=None,
    device_memory: int | None = None,
    sequence_parallel: bool = False,
    strict: bool = True,
) -> LayoutPlan:
    """Plan the layout of a preset's weights on a device mesh.

    Reads only the preset's `config.json`; no weight is allocated and no
    device is needed when the mesh is given as a mapping. A local folder
    (or config dict) of a built-in family planned for a mapping imports
    neither Keras, keras-hub nor JAX.

    Args:
        preset: what to plan: a preset, i.e. a local folder (Keras or
            Hugging Face format; a string or a `pathlib.Path`), `hf://…`,
            `kaggle://…` or a built-in preset name; a config dict, i.e. a
            Keras preset's `config.json` (with `registered_name`), a Hugging
            Face `config.json` (with `model_type`) or
            `{"class_name": "GemmaBackbone", "config": backbone.get_config()}`
            (`class_name` may be the class itself); or a keras-hub backbone
            or task instance (its backbone's class and `get_config()`).
            `plan.preset` then reads e.g. `"<GemmaBackbone instance>"` or
            `"<config dict>"`.
        device_mesh: a `keras.distribution.DeviceMesh`, a mapping of axis
            name to size such as `{"batch": 2, "model": 4}`, or `"auto"`
            (all of JAX's devices, split as `auto_mesh` decides).
        strategy: `"tp"` (weights sharded over the model axes, replicated over
            the batch axis), `"fsdp"` (also sharded over the batch axis) or
            `"auto"` (`"tp"` when weights, gradients and Adam state take at
            most 80% of a device's memory or the batch axis has size 1,
            else `"fsdp"`).
        batch_axis: the mesh axis that splits batches, if not `batch`/`data`.
        model_axis: the mesh axis that shards weights, if not
            `model`/`tensor`.
        dtype: the dtype (policy) the model will be loaded with; defaults to
            the preset's.
        device_memory: per-device bytes; defaults to
            `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB`, what the devices report,
            or 16 GiB (`plan.memory_note()` says which).
        sequence_parallel: also shard the activations tensor parallelism
            replicates (the residual stream: norms, residual adds, dropout)
            on their sequence dimension over the model axis, Megatron-style;
            `plan.layout_map()` then holds `<layer>/output` keys. Needs a
            model axis of more than one device to change anything.
        strict: every variable of the model must match exactly one rule of
            its family's table: with `True` a variable that matches none
            raises `UnplannedWeightError`; with `False` it warns
            (`UnplannedWeightWarning`) and is planned replicated.

    Returns:
        A `LayoutPlan`; `plan.fits` tells whether training fits.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 16, "model": 16})
    print(plan.max_device_bytes, plan.strategy, plan.fits)
    plan = keras_hub_autodist.plan(backbone, {"batch": 2, "model": 4})
    ```
    """
    preset_config = read_config(preset)
    mesh_reason = ""
    if isinstance(device_mesh, str):
        device_mesh, mesh_reason, device_memory = resolve_auto_mesh(
            preset_config, device_mesh, dtype=dtype, device_memory=device_memory
        )
    result = plan_config(
        preset_config,
        device_mesh,
        strategy=strategy,
        batch_axis=batch_axis,
        model_axis=model_axis,
        dtype=dtype,
        device_memory=device_memory,
        sequence_parallel=sequence_parallel,
        strict=strict,
    )
    return result.replace(mesh_reason=mesh_reason) if mesh_reason else result


def get_layout_map(preset, device_mesh, **options) -> keras.distribution.LayoutMap:
    """A config-aware `LayoutMap` for users who keep their own scope.

    The drop-in for `GemmaBackbone.get_layout_map(mesh)`: it reads the
    preset's config, so MQA/GQA models, untied embeddings and LoRA kernels
    are laid out correctly.

    Args:
        preset: as for `plan()`: a preset (string or path), a config dict,
            or a backbone or task instance.
        device_mesh: a `keras.distribution.DeviceMesh`.
        **options: `strategy`, `batch_axis`, `model_axis`, `dtype`,
            `device_memory`, `sequence_parallel`, as for `plan()`.

    Example:
    ```python
    layout_map = keras_hub_autodist.get_layout_map("./gemma_2b", mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
    ```
    """
    if not is_device_mesh(device_mesh):
        raise MeshError(
            "`get_layout_map` builds a LayoutMap, which needs a real "
            "`keras.distribution.DeviceMesh`; use `plan()` to plan for a "
            f"mesh given by axis sizes. Received: device_mesh={device_mesh!r}"
        )
    return plan(preset, device_mesh, **options).layout_map()
