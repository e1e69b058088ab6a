"""`LayoutPlan`: where every weight of a model goes on a mesh, and its cost."""

from __future__ import annotations

import dataclasses
import math
import os

import keras
import ml_dtypes
import numpy as np

from keras_hub_autodist import rules
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.mesh import MeshAxes
from keras_hub_autodist.mesh import resolve_mesh_axes
from keras_hub_autodist.presets import PresetConfig
from keras_hub_autodist.presets import read_preset_config
from keras_hub_autodist.presets import variable_dtype
from keras_hub_autodist.registry import handler_for

STRATEGY_CHOICES = ("auto",) + rules.STRATEGIES
DEVICE_MEMORY_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB"
# Bytes per parameter while training with Adam: the weight, its gradient and
# the two moments, all in the variable dtype.
ADAM_STATE_FACTOR = 4


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
        note: the fallbacks taken, with their reasons ("" if none).
    """

    path: str
    pattern: str
    shape: tuple[int, ...]
    logical_axes: tuple[str, ...]
    spec: tuple[str | None, ...]
    dtype: str
    bytes: int
    device_bytes: int
    note: str


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
        rows: list[PlanRow],
        device_memory_bytes: int,
        device_mesh=None,
    ):
        self.preset = preset
        self.backbone_class = backbone_class
        self.architecture = architecture
        self.mesh_axes = mesh_axes
        self.strategy = strategy
        self.strategy_reason = strategy_reason
        self.dtype = dtype
        self.rows = list(rows)
        self.device_memory_bytes = device_memory_bytes
        self.device_mesh = device_mesh

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
        factors = {"adam": 4, "sgd": 2, "sgd_momentum": 3}
        if optimizer not in factors:
            raise ValueError(
                f"Unknown optimizer for the memory estimate. Use one of "
                f"{sorted(factors)}. Received: optimizer={optimizer!r}"
            )
        return factors[optimizer] * self.max_device_bytes

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
        for pattern, spec in self._layouts().items():
            layout_map[pattern] = spec
        return layout_map

    def _layouts(self) -> dict[str, tuple]:
        layouts = {}
        for row in self.rows:
            previous = layouts.setdefault(row.pattern, row.spec)
            if previous != row.spec:
                raise AssertionError(
                    f"Weights matching {row.pattern!r} got different layouts "
                    f"({previous} and {row.spec}); this is a planner bug."
                )
        for row in list(self.rows):
            if row.path.endswith("/kernel") and len(row.spec) >= 2:
                base = row.pattern[: -len("kernel")]
                layouts.setdefault(base + "lora_kernel_a", row.spec[:-1] + (None,))
                layouts.setdefault(base + "lora_kernel_b", (None, row.spec[-1]))
        return layouts

    def summary(self) -> str:
        """Per-device totals, one line each."""
        size = _format_bytes
        axes = self.mesh_axes
        return "\n".join(
            [
                f"preset: {self.preset} ({self.backbone_class}, {self.architecture})",
                f"mesh: {axes.describe()} (batch axis: {axes.batch_axis}, model "
                f"axis: {axes.model_axis}, hidden axis: {axes.hidden_axis})",
                f"strategy: {self.strategy} ({self.strategy_reason})",
                f"parameters: {self.num_parameters:,} ({self.dtype}), "
                f"{size(self.total_bytes)} in all",
                f"per device: {size(self.max_device_bytes)} of parameters (ideal "
                f"{size(self.ideal_device_bytes)}), about "
                f"{size(self.training_bytes_per_device())} to train with Adam "
                f"(of {size(self.device_memory_bytes)})",
                f"fallbacks: {len(self.fallbacks)} weights",
            ]
        )

    def table(self) -> str:
        """The weights grouped by layout-map key, with spec, bytes and notes."""
        groups: dict[str, list[PlanRow]] = {}
        for row in self.rows:
            groups.setdefault(row.pattern, []).append(row)
        header = ("weight", "count", "shape", "spec", "per device", "note")
        body = []
        for pattern, rows in groups.items():
            row = rows[0]
            body.append(
                (
                    pattern.replace(r"\d+", "*").replace("\\", ""),
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


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def device_memory_bytes(device_mesh=None, override: int | None = None) -> int:
    """Per-device memory used by strategy `"auto"`.

    In order: `override`; `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB`; the
    smallest `bytes_limit` the backend reports for the mesh's devices; else
    `rules.DEFAULT_DEVICE_MEMORY_BYTES` (16 GiB).

    Args:
        device_mesh: a `DeviceMesh` whose devices to ask, or `None`.
        override: bytes to use as-is.
    """
    if override is not None:
        return int(override)
    from_env = os.environ.get(DEVICE_MEMORY_ENV)
    if from_env:
        try:
            return int(float(from_env) * 1024**3)
        except ValueError as error:
            raise MeshError(
                f"${DEVICE_MEMORY_ENV} must be a number of GiB, e.g. 16. "
                f"Received: {DEVICE_MEMORY_ENV}={from_env!r}"
            ) from error
    if isinstance(device_mesh, keras.distribution.DeviceMesh):
        limits = []
        for device in np.ravel(device_mesh.backend_mesh.devices):
            # Only this process's devices can report (multi-host meshes).
            if device not in device.client.local_devices():
                continue
            try:
                stats = device.memory_stats()
            except Exception:  # backends without memory statistics
                stats = None
            if stats and stats.get("bytes_limit"):
                limits.append(stats["bytes_limit"])
        if limits:
            return min(limits)
    return rules.DEFAULT_DEVICE_MEMORY_BYTES


def _rows_for(weights, mesh_axes, strategy, fields, dtype, kv_fallback):
    itemsize = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).itemsize
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
                note="; ".join(notes),
            )
        )
    return rows


def _plan_rows(weights, mesh_axes, strategy, fields, dtype):
    """The rows and why K/V were laid out so, when their heads don't divide.

    Unshardable K/V heads are replicated unless that costs too much memory,
    in which case their head_dim is sharded.
    """

    def rows_with(kv_fallback):
        return _rows_for(weights, mesh_axes, strategy, fields, dtype, kv_fallback)

    model_size = mesh_axes.size(mesh_axes.model_axis)
    heads = [w for w in weights if "heads" in w.axes]
    kv = [w for w in weights if "kv_heads" in w.axes]
    if model_size == 1 or not kv:
        return rows_with("replicate"), ""
    kv_heads = kv[0].shape[kv[0].axes.index("kv_heads")]
    if kv_heads % model_size == 0:
        return rows_with("replicate"), ""
    if heads and heads[0].shape[heads[0].axes.index("heads")] % model_size:
        return rows_with("head_dim"), "query heads are sharded on head_dim, so are K/V"
    replicated, sharded = rows_with("replicate"), rows_with("head_dim")
    cost = sum(r.device_bytes for r in replicated) / max(
        1, sum(r.device_bytes for r in sharded)
    )
    if cost <= rules.KV_REPLICATION_TOLERANCE:
        return replicated, f"K/V replicated: costs {cost:.3f}x per device"
    return sharded, (
        f"K/V sharded on head_dim: replicating would cost {cost:.3f}x per "
        f"device (> {rules.KV_REPLICATION_TOLERANCE})"
    )


def tp_fits(tp_plan: LayoutPlan) -> bool:
    """Whether a `"tp"` plan's weights, gradients and Adam state fit the
    planned device memory with room for activations (the `"auto"` rule)."""
    budget = rules.AUTO_TP_MEMORY_SHARE * tp_plan.device_memory_bytes
    return tp_plan.training_bytes_per_device("adam") <= budget


def plan_config(
    preset_config: PresetConfig,
    device_mesh,
    *,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    dtype=None,
    device_memory: int | None = None,
) -> LayoutPlan:
    """`plan()` for a config already read with `read_preset_config`."""
    if strategy not in STRATEGY_CHOICES:
        raise StrategyError(
            f"Unknown strategy. Use one of {list(STRATEGY_CHOICES)}. "
            f"Received: strategy={strategy!r}"
        )
    mesh_axes = resolve_mesh_axes(
        device_mesh, batch_axis=batch_axis, model_axis=model_axis
    )
    handler = handler_for(preset_config.backbone_cls)
    weights = handler.weights(preset_config.config)
    fields = dict(handler.config_fields)
    var_dtype = variable_dtype(preset_config.config, dtype)
    capacity = device_memory_bytes(device_mesh, device_memory)

    def build(chosen, reason):
        rows, kv_reason = _plan_rows(weights, mesh_axes, chosen, fields, var_dtype)
        if kv_reason:
            rows = [
                dataclasses.replace(r, note=f"{r.note} ({kv_reason})")
                if r.note and "kv_heads" in r.logical_axes
                else r
                for r in rows
            ]
        return LayoutPlan(
            preset=str(preset_config.preset),
            backbone_class=preset_config.backbone_cls.__name__,
            architecture=handler.name,
            mesh_axes=mesh_axes,
            strategy=chosen,
            strategy_reason=reason,
            dtype=var_dtype,
            rows=rows,
            device_memory_bytes=capacity,
            device_mesh=device_mesh
            if isinstance(device_mesh, keras.distribution.DeviceMesh)
            else None,
        )

    if strategy != "auto":
        return build(strategy, "requested")
    tp = build("tp", "")
    need = tp.training_bytes_per_device("adam")
    gib = 1024**3
    if tp_fits(tp):
        tp.strategy_reason = (
            f"auto: weights+grads+Adam {need / gib:.2f} GiB per device fit in "
            f"{rules.AUTO_TP_MEMORY_SHARE:.0%} of {capacity / gib:.1f} GiB"
        )
        return tp
    return build(
        "fsdp",
        f"auto: with tp, weights+grads+Adam need {need / gib:.2f} GiB per "
        f"device, over {rules.AUTO_TP_MEMORY_SHARE:.0%} of "
        f"{capacity / gib:.1f} GiB",
    )


def plan(
    preset: str,
    device_mesh,
    *,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    dtype=None,
    device_memory: int | None = None,
) -> LayoutPlan:
    """Plan the layout of a preset's weights on a device mesh.

    Reads only the preset's `config.json`; no weight is allocated and no
    device is needed when the mesh is given as a mapping.

    Args:
        preset: a local folder (Keras or Hugging Face format), `hf://…`,
            `kaggle://…` or a built-in preset name.
        device_mesh: a `keras.distribution.DeviceMesh`, or a mapping of axis
            name to size such as `{"batch": 2, "model": 4}`.
        strategy: `"tp"` (weights sharded over the model axes, replicated over
            the batch axis), `"fsdp"` (also sharded over the batch axis) or
            `"auto"` (`"tp"` when weights, gradients and Adam state take at
            most 80% of a device's memory, else `"fsdp"`).
        batch_axis: the mesh axis that splits batches, if not `batch`/`data`.
        model_axis: the mesh axis that shards weights, if not
            `model`/`tensor`.
        dtype: the dtype (policy) the model will be loaded with; defaults to
            the preset's.
        device_memory: per-device bytes for `"auto"`; defaults to what the
            backend reports, `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB`, or 16 GiB.

    Returns:
        A `LayoutPlan`.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 16, "model": 16})
    print(plan.max_device_bytes, plan.strategy)
    ```
    """
    return plan_config(
        read_preset_config(preset),
        device_mesh,
        strategy=strategy,
        batch_axis=batch_axis,
        model_axis=model_axis,
        dtype=dtype,
        device_memory=device_memory,
    )


def get_layout_map(preset: str, device_mesh, **options) -> keras.distribution.LayoutMap:
    """A config-aware `LayoutMap` for users who keep their own scope.

    The drop-in for `GemmaBackbone.get_layout_map(mesh)`: it reads the
    preset's config, so MQA/GQA models, untied embeddings and LoRA kernels
    are laid out correctly.

    Args:
        preset: as for `plan()`.
        device_mesh: a `keras.distribution.DeviceMesh`.
        **options: `strategy`, `batch_axis`, `model_axis`, `dtype`,
            `device_memory`, as for `plan()`.

    Example:
    ```python
    layout_map = keras_hub_autodist.get_layout_map("./gemma_2b", mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
    ```
    """
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise MeshError(
            "`get_layout_map` builds a LayoutMap, which needs a real "
            "`keras.distribution.DeviceMesh`; use `plan()` to plan for a "
            f"mesh given by axis sizes. Received: device_mesh={device_mesh!r}"
        )
    return plan(preset, device_mesh, **options).layout_map()
