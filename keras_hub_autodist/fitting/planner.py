"""`plan()`: the third step of the data path, from weights to a `LayoutPlan`.

The planner reads the config (`presets.read_config`), gets every weight with
its logical axes (`shapes.model_weights`), asks each device's memory
(`device_memory.device_memory_info`), then has the planning stage lay the
weights out on the mesh (`layouts`). Where it must choose (the mesh under
`device_mesh="auto"`, the strategy under `strategy="auto"`, the key/value
layout when key/value heads don't divide the model axis), planning counts
every alternative's parameter bytes in one pass over the weights, the
closed form (`trained_state.state_need`) says what each needs of a device,
and `policy` chooses; only the chosen layout becomes rows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from keras_hub_autodist.compat.random_state import global_random_kept
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import option
from keras_hub_autodist.fitting import policy
from keras_hub_autodist.fitting.device_memory import device_memory_info
from keras_hub_autodist.fitting.device_profiles import device_profile
from keras_hub_autodist.fitting.layout_plan import LayoutPlan
from keras_hub_autodist.fitting.trained_state import state_need
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.layouts import Alternative
from keras_hub_autodist.planning.layouts import KVCosts
from keras_hub_autodist.planning.layouts import check_sequence_split
from keras_hub_autodist.planning.layouts import kv_costs
from keras_hub_autodist.planning.layouts import rows
from keras_hub_autodist.planning.mesh import ResolvedMesh
from keras_hub_autodist.planning.mesh import check_device_count
from keras_hub_autodist.planning.mesh import read_device_mesh
from keras_hub_autodist.planning.mesh import require_device_mesh
from keras_hub_autodist.planning.mesh import resolve_mesh_axes
from keras_hub_autodist.planning.options import PLANNING_KEYWORDS
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.shapes import ModelWeights
from keras_hub_autodist.planning.shapes import model_weights
from keras_hub_autodist.reading.presets import read_config

if TYPE_CHECKING:
    import keras


@global_random_kept()  # planning never moves the user's random streams
def plan(
    preset: str | os.PathLike | Mapping,
    device_mesh: keras.distribution.DeviceMesh | Mapping[str, int] | str,
    *,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    context_axis: str | None = None,
    context_parallel_strategy: str = "all_gather",
    dtype: str | None = None,
    device_memory: int | str | None = None,
    lora_rank: int | None = None,
    remat: str | Mapping | None = None,
    sequence_parallel: bool = False,
    strict: bool = True,
    num_devices: int | None = None,
    batch_size: int | None = None,
) -> LayoutPlan:
    """Plan the layout of a preset's weights on a device mesh.

    Reads only the preset's `config.json`; no weight is allocated and no
    device is needed when the mesh is given as a mapping. A local folder
    (or config dict) of a built-in family planned for a mapping imports
    neither Keras, keras-hub nor JAX once its abstract build is cached.

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
            (all of JAX's devices, split as `policy.choose_mesh` decides).
        strategy: `"tp"` (weights sharded over the model axes, replicated over
            the batch axis), `"fsdp"` (also sharded over the batch axis) or
            `"auto"` (`"tp"` when weights, gradients and Adam state take at
            most 80% of a device's memory or the batch axis has size 1,
            else `"fsdp"`).
        batch_axis: the mesh axis that splits batches, if not `batch`/`data`.
        model_axis: the mesh axis that shards weights, if not
            `model`/`tensor`.
        context_axis: the mesh axis that splits each sequence (context
            parallelism: tokens, activations and attention's queries are
            split over it; keys and values are gathered), if not `context`.
        context_parallel_strategy: how keys and values reach each device's
            queries on a context axis: `"all_gather"` (default; the whole
            sequence's, gathered once per layer; on a TPU each device then
            attends with the fused splash kernel) or `"ring"` (passed
            around the axis block by block; each device holds its own block
            and the one arriving, not the whole sequence's, and attends
            with the blockwise kernel). See docs/long-context.md.
        dtype: the dtype (policy) the model will be loaded with; defaults to
            the preset's.
        device_memory: per-device bytes, or a named device such as `"t4"`,
            `"v3-8"` or `"a100-80"` (`device_profiles.DEVICE_PROFILES`: its
            memory per device); defaults to
            `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB`, what the devices report,
            or 16 GiB (`plan.memory_note()` says which).
        lora_rank: plan a LoRA fine-tune of this rank (keras-hub's
            `enable_lora(rank)`: the query and value kernels gain rank-`r`
            adapters, the only weights trained): the memory answers then
            count gradients and optimizer state for the LoRA kernels alone.
        remat: plan a training step with rematerialization, as
            `from_preset(..., remat=...)` builds it: a block policy
            (`"full"`, `"dots"`: what each decoder block keeps,
            `remat_arguments.BLOCK_POLICIES`), a `keras.RematScope` mode
            (`"larger_than"`, `"list_of_layers"`) or a dict of its
            arguments. The activation estimate counts the block policies.
        sequence_parallel: also shard the activations tensor parallelism
            replicates (the residual stream: norms, residual adds, dropout)
            on their sequence dimension over the model axis, Megatron-style;
            `plan.layout_map()` then holds `<layer>/output` keys. Needs a
            model axis of more than one device to change anything.
        strict: every variable of the model must match exactly one rule of
            its family's table: with `True` a variable that matches none
            raises `UnplannedWeightError`; with `False` it warns
            (`UnplannedWeightWarning`) and is planned replicated.
        num_devices: with `device_mesh="auto"`, choose the mesh for this
            many devices without asking JAX (the CLI's `--devices`).
        batch_size: with `device_mesh="auto"`, the global batch of the
            training step planned for (the CLI's `--batch`): only a batch
            axis that divides it is chosen, so that no row is padded.

    Returns:
        A `LayoutPlan`; `plan.fits` tells whether training fits.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 16, "model": 16})
    print(plan.max_device_bytes, plan.strategy, plan.fits)
    plan = keras_hub_autodist.plan(backbone, {"batch": 2, "model": 4})
    ```
    """
    options = PlanOptions(
        strategy=strategy,
        batch_axis=batch_axis,
        model_axis=model_axis,
        context_axis=context_axis,
        context_parallel_strategy=context_parallel_strategy,
        dtype=dtype,
        device_memory=device_memory,
        lora_rank=lora_rank,
        remat=remat,
        sequence_parallel=sequence_parallel,
        strict=strict,
    )
    # A named device is looked up before the preset is read.
    device_name(options.device_memory)
    weights = model_weights(read_config(preset), options)
    mesh = resolve_mesh(
        device_mesh, weights, options, num_devices=num_devices, batch_size=batch_size
    )
    return plan_model(weights, mesh, options)


def get_layout_map(
    preset: str | os.PathLike | Mapping,
    device_mesh: keras.distribution.DeviceMesh | Mapping[str, int] | str,
    **options: Any,
) -> keras.distribution.LayoutMap:
    """A config-aware `LayoutMap` for users who keep their own scope.

    The drop-in for `GemmaBackbone.get_layout_map(mesh)`: it reads the
    preset's config, so MQA/GQA models, untied embeddings and LoRA kernels
    are laid out correctly.

    Args:
        preset: as for `plan()`: a preset (string or path), a config dict,
            or a backbone or task instance.
        device_mesh: a `keras.distribution.DeviceMesh`.
        **options: `strategy`, `batch_axis`, `model_axis`, `dtype`,
            `device_memory`, `sequence_parallel`, `strict`, as for `plan()`.

    Example:
    ```python
    layout_map = keras_hub_autodist.get_layout_map("./gemma_2b", mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
    ```
    """
    require_device_mesh(
        device_mesh,
        "`get_layout_map` builds a LayoutMap, which needs a real "
        "`keras.distribution.DeviceMesh`; use `plan()` to plan for a mesh "
        "given by axis sizes.",
    )
    unknown = sorted(set(options) - set(PLANNING_KEYWORDS))
    if unknown:
        raise ArgumentError(
            f"`get_layout_map` takes the planning options of `plan()`: "
            f"{list(PLANNING_KEYWORDS)}; pass those only. Received: "
            f"{', '.join(f'{name}=' for name in unknown)}"
        )
    return plan(preset, device_mesh, **options).layout_map(device_mesh)


def resolve_mesh(
    device_mesh,
    model: ModelWeights,
    options: PlanOptions,
    *,
    devices=None,
    num_devices: int | None = None,
    batch_size: int | None = None,
) -> ResolvedMesh:
    """`device_mesh=` resolved once, into the mesh every later step takes.

    A `DeviceMesh` spans its own devices; a mapping spans `devices` (none
    when planning without devices); `"auto"` is chosen here
    (`policy.choose_mesh`, each candidate's `"tp"` plan costed in one pass
    over the weights) for `num_devices`, else for `devices`, else for all
    of JAX's devices. The memory per device is asked of those devices
    unless `options.device_memory` gives it (`device_memory.device_memory_info`).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh`, a mapping of axis
            name to size, or `"auto"`.
        model: the weights from `shapes.model_weights`.
        options: the plan's options (`batch_axis`, `model_axis`,
            `device_memory`).
        devices: the devices a mapping or `"auto"` lays out.
        num_devices: with `"auto"`, plan for this many devices without
            asking JAX.
        batch_size: with `"auto"`, choose only a batch axis that divides
            this global batch.

    Example:
    ```python
    options = PlanOptions()
    weights = model_weights(read_config("./gemma_2b"), options)
    resolve_mesh({"batch": 2, "model": 4}, weights, options).axes.shape
    ```
    """
    argument = read_device_mesh(device_mesh)
    for name, value in (("num_devices", num_devices), ("batch_size", batch_size)):
        if value is not None and not argument.auto:
            raise MeshError(
                f"{option(name)} goes with {option('device_mesh', repr('auto'))}, "
                "which it helps choose; a mesh given by axis sizes has as many "
                "devices as their product, and pads a batch its batch axis "
                f"doesn't divide. Received: {name}={value!r}, "
                f"device_mesh={device_mesh!r}"
            )
    reason = ""
    if argument.auto:
        count = _device_count(num_devices)
        if count is None:
            if devices is None:
                import jax

                devices = jax.devices()
            count = len(devices)
        capacity, source = device_memory_info(devices or (), options.device_memory)
        shape, reason = auto_mesh(
            model, options, count, capacity, source, _batch_size(batch_size)
        )
        argument = read_device_mesh(shape)
    else:
        if argument.devices is not None:
            devices = argument.devices
        capacity, source = None, None
    # The mesh is checked before its devices are asked for their memory.
    axes = resolve_mesh_axes(
        argument,
        batch_axis=options.batch_axis,
        model_axis=options.model_axis,
        context_axis=options.context_axis,
    )
    if capacity is None:
        capacity, source = device_memory_info(devices or (), options.device_memory)
    return ResolvedMesh(
        axes,
        None if devices is None else tuple(devices),
        capacity,
        source,
        reason,
        argument.device_mesh,
    )


def _batch_size(batch_size) -> int | None:
    if batch_size is None:
        return None
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise MeshError(
            "The batch the automatic mesh is chosen for is a positive integer "
            f"or None. Received: batch_size={batch_size}"
        )
    return batch_size


def _device_count(num_devices) -> int | None:
    if num_devices is None:
        return None
    if isinstance(num_devices, bool) or not isinstance(num_devices, int):
        raise MeshError(
            "The number of devices is a positive integer. Received: "
            f"num_devices={num_devices!r}"
        )
    if num_devices < 1:
        raise MeshError(
            f"The number of devices is a positive integer; pass "
            f"{option('num_devices')}. Received: num_devices={num_devices!r}"
        )
    return check_device_count(num_devices, received=f"num_devices={num_devices!r}")


def plan_model(
    model: ModelWeights, mesh: ResolvedMesh, options: PlanOptions
) -> LayoutPlan:
    """Lay out `model`'s weights on `mesh`, choosing by memory where
    `options` leave the choice.

    Under `strategy="auto"` every strategy is costed, under key/value heads
    that don't divide the model axis every key/value layout, in one pass
    over the weights (`layouts.kv_costs`); `policy` chooses from what each
    needs of a device's memory. Only the chosen layout becomes rows.

    Args:
        model: the weights from `shapes.model_weights`.
        mesh: the mesh from `resolve_mesh`.
        options: the plan's options.

    Returns:
        A `LayoutPlan`.

    Example:
    ```python
    options = PlanOptions()
    weights = model_weights(read_config("./gemma_2b"), options)
    plan_model(weights, resolve_mesh({"batch": 2, "model": 4}, weights,
               options), options)
    ```
    """
    mesh_axes = mesh.axes
    capacity = mesh.device_memory_bytes
    check_sequence_split(options, mesh_axes)
    strategies = (
        sharding.STRATEGIES if options.strategy == "auto" else (options.strategy,)
    )
    costs = {
        c.strategy: c
        for c in kv_costs(model, [(mesh_axes, strategy) for strategy in strategies])
    }
    kv = {
        strategy: _choose_kv(model, options, c, capacity)
        for strategy, c in costs.items()
    }
    if options.strategy == "auto":
        tp_need = state_need(
            model.weights,
            model.dtype,
            options.lora_rank,
            costs["tp"].held[kv["tp"][0]],
        )
        strategy, strategy_reason = policy.choose_strategy(
            tp_need,
            capacity,
            mesh.device_memory_source,
            mesh_axes.sizes[mesh_axes.batch_axis],
        )
    else:
        strategy, strategy_reason = options.strategy, "requested"
    kv_fallback, kv_policy = kv[strategy]
    return LayoutPlan(
        preset=model.preset,
        backbone_class=model.backbone_class,
        architecture=model.architecture,
        mesh_axes=mesh_axes,
        strategy=strategy,
        strategy_reason=strategy_reason,
        dtype=model.dtype,
        rows=rows(model, Alternative(mesh_axes, strategy, kv_fallback), kv_policy),
        device_memory_bytes=capacity,
        device_memory_source=mesh.device_memory_source,
        mesh_reason=mesh.reason,
        config_fields=model.config_fields,
        context_parallel_strategy=options.context_parallel_strategy,
        sequence_parallel=options.sequence_parallel,
        sequence_parallel_outputs=model.sequence_parallel_outputs,
        lora_rank=options.lora_rank,
        remat=options.remat,
        device_name=device_name(options.device_memory),
        final_logit_soft_cap=model.final_logit_soft_cap,
        mixed_policy=model.mixed_policy,
    )


def auto_mesh(
    model: ModelWeights,
    options: PlanOptions,
    num_devices: int,
    capacity: int,
    source: str,
    batch_size: int | None = None,
) -> tuple[dict[str, int], str]:
    """The mesh `device_mesh="auto"` picks, and why: every candidate's
    `"tp"` plan costed in one pass over the weights, then
    `policy.choose_mesh`.

    Example:
    ```python
    auto_mesh(weights, PlanOptions(), 8, 16 * GIB, "given", batch_size=8)
    ```
    """
    candidates = [
        resolve_mesh_axes(m) for m in policy.mesh_candidates(num_devices, batch_size)
    ]
    needs = []
    for costs in kv_costs(model, [(mesh_axes, "tp") for mesh_axes in candidates]):
        kv_fallback, _ = _choose_kv(model, options, costs, capacity)
        needs.append(
            state_need(
                model.weights, model.dtype, options.lora_rank, costs.held[kv_fallback]
            )
        )
    return policy.choose_mesh(needs, num_devices, capacity, source, batch_size)


def device_name(device_memory) -> str:
    """The name of the device `device_memory=` names, or `""` for bytes.

    Raises:
        PlanError: for a name not in `device_profiles.DEVICE_PROFILES`.
    """
    return device_profile(device_memory).name if isinstance(device_memory, str) else ""


def _choose_kv(model, options, costs: KVCosts, capacity) -> tuple[str, str]:
    """The key/value layout and why, from what planning counted.

    Where the layout alone decides it, that (`KVCosts.fixed`). Otherwise
    `policy.choose_kv_layout` takes the one moving the fewest bytes among
    those whose weights, gradients and Adam state fit `capacity` and whose
    parameters meet the per-device target
    (`policy.TP_DEVICE_BYTES_TARGET` x total / model-axis size for "tp",
    `policy.FSDP_DEVICE_BYTES_TARGET` x total / devices for "fsdp").
    """
    if costs.fixed is not None:
        return costs.fixed
    if costs.strategy == "fsdp":
        target = policy.FSDP_DEVICE_BYTES_TARGET
    else:
        target = policy.TP_DEVICE_BYTES_TARGET
    candidates = []
    for layout in policy.KV_LAYOUTS:
        bytes_held = costs.held[layout.kv_fallback]
        candidates.append(
            policy.KVCandidate(
                layout,
                state_need(model.weights, model.dtype, options.lora_rank, bytes_held),
                bytes_held / costs.ideal,
            )
        )
    chosen, reason = policy.choose_kv_layout(
        candidates,
        capacity=capacity,
        target=target,
        strategy=costs.strategy,
        axis=costs.mesh_axes.model_axis,
    )
    return chosen.kv_fallback, reason
