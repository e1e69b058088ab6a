"""`from_preset(..., device_mesh=...)`: the data path, read top to bottom.

    read the config → weights (abstract build) → plan → load → verify → bind

1. `presets.read_preset_config`: the backbone class and config keras-hub will
   build from (only `config.json` is read).
2. `shapes.model_weights`: every weight's path, shape and logical axes, from
   the model built abstractly (nothing allocated).
3. `planner.resolve_mesh`: `device_mesh=` resolved once (chosen, when
   `"auto"`), then `planner.plan_model`: the `LayoutPlan` on it, as values.
4. `loading.sharded_loading`: keras-hub's own `from_preset` runs inside the
   plan's `ModelParallel` scope, and each weight goes straight into its
   shards.
5. `verify`: every built variable matches its plan and is laid out as
   planned.
6. `binding.bind`: the model's methods run inside its distribution.

Each step takes the previous step's value and never calls back up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import keras

from keras_hub_autodist.attention.context_attention import install_per_device_attention
from keras_hub_autodist.attention.xla_path import attention_through_xla
from keras_hub_autodist.compat.random_state import global_random_kept
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import BackendError
from keras_hub_autodist.errors import ModelClassError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import warn
from keras_hub_autodist.fitting.planner import plan_model
from keras_hub_autodist.fitting.planner import resolve_mesh
from keras_hub_autodist.loading.progress import progress_enabled
from keras_hub_autodist.loading.session import attach_load_stats
from keras_hub_autodist.loading.session import sharded_loading
from keras_hub_autodist.loading.verify import verify_layouts
from keras_hub_autodist.planning.distribution import plan_distribution
from keras_hub_autodist.planning.options import PLAN_ONLY_KEYWORDS
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.options import progress_option
from keras_hub_autodist.planning.options import split_auto_remat
from keras_hub_autodist.planning.remat import remat_scope
from keras_hub_autodist.planning.remat import rematerialize_blocks
from keras_hub_autodist.planning.shapes import model_weights
from keras_hub_autodist.planning.weight_check import WeightCheck
from keras_hub_autodist.reading.dtypes import is_quantized
from keras_hub_autodist.reading.loaders import cached_kaggle_snapshot
from keras_hub_autodist.reading.loaders import is_network_error
from keras_hub_autodist.reading.presets import read_preset_config
from keras_hub_autodist.searching.auto_mesh import searched_layout
from keras_hub_autodist.summary_line import print_summary
from keras_hub_autodist.training.binding import bind

# The attribute of the plugin's `from_preset` wrapper that holds keras-hub's
# own method (shared with the startup hook's guard).
ORIGINAL_ATTR = "__keras_hub_autodist_original__"


def require_jax_backend() -> None:
    """Raise `BackendError` unless Keras runs on JAX."""
    backend = keras.config.backend()
    if backend != "jax":
        raise BackendError(
            "keras_hub_autodist distributes models with JAX sharding, but "
            f"Keras runs on {backend!r}: Keras was imported before "
            "keras_hub_autodist could choose JAX (or KERAS_BACKEND names "
            "another backend), and its backend can't change once it is "
            "imported. Set KERAS_BACKEND=jax before Keras is imported "
            "(`export KERAS_BACKEND=jax`, or `os.environ['KERAS_BACKEND'] = "
            "'jax'` / `import keras_hub_autodist` first in the script or the "
            "notebook's first cell), then restart the Python process or "
            f"kernel. Received: backend={backend!r}"
        )


def original_from_preset(cls):
    """keras-hub's own `from_preset` of `cls`, under any wrapper of ours."""
    for klass in getattr(cls, "__mro__", ()):
        method = klass.__dict__.get("from_preset")
        if method is not None:
            func = method.__func__
            return getattr(func, ORIGINAL_ATTR, func)
    raise ModelClassError(
        f"{getattr(cls, '__name__', cls)} has no from_preset. Pass a keras-hub "
        f"Backbone or Task class. Received: cls={cls!r}"
    )


def from_preset(
    cls: type,
    preset: str,
    *,
    device_mesh: keras.distribution.DeviceMesh | Mapping[str, int] | str,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    context_axis: str | None = None,
    context_parallel_strategy: str = "all_gather",
    progress: bool | None = None,
    strict: bool = True,
    sequence_parallel: bool = False,
    remat: str | Mapping | None = None,
    **kwargs: Any,
) -> keras.Model:
    """Load `cls` from `preset`, laid out on `device_mesh` and bound to it.

    Each weight goes straight into its shards: no device ever holds more
    than its final share plus one weight's shard, and the host at most one
    weight's slices (see `keras_hub_autodist.loading.session`).

    Args:
        cls: a keras-hub `Backbone` or `Task` class, e.g.
            `keras_hub.models.GemmaCausalLM`.
        preset: anything `cls.from_preset` accepts.
        device_mesh: a `keras.distribution.DeviceMesh`, a mapping of axis name
            to size (built over `keras.distribution.list_devices()`), or
            `"auto"`.
        strategy: `"auto"`, `"tp"` or `"fsdp"` (see `plan()`).
        batch_axis: the mesh axis that splits batches.
        model_axis: the mesh axis that shards weights.
        context_axis: the mesh axis that splits each sequence (context
            parallelism), if not `context` (see `plan()`).
        context_parallel_strategy: how keys and values reach each device
            on a context axis: `"all_gather"` or `"ring"` (see `plan()`).
        progress: show a progress bar while loading; by default what
            `$KERAS_HUB_AUTODIST_PROGRESS` says (`1`/`0`, `on`/`off`...), else
            on a terminal only.
        strict: every weight of the built model must match exactly one rule
            of the plan: with `True` a weight that matches none raises
            `UnplannedWeightError`; with `False` it warns
            (`UnplannedWeightWarning`) and the weight stays replicated. A
            weight built with another shape than planned always raises
            `WeightShapeError`.
        sequence_parallel: Megatron-style sequence parallelism: the
            activations tensor parallelism replicates (norms, residual adds,
            dropout) are sharded on the sequence over the model axis (see
            `plan()`).
        remat: rematerialization: a block policy (`"full"`: each decoder
            block keeps its inputs and recomputes the rest in the backward
            pass; `"dots"`: it also keeps its weight matmuls' outputs), or
            a `keras.RematScope` mode (`"larger_than"`,
            `"list_of_layers"`) or a dict of its arguments
            (`{"mode": "larger_than", "output_size_threshold": 2**20}`), the
            model then built inside that scope. With `device_mesh="auto"`,
            also `"auto"`: the remat of the layout search's winner
            (`searching.auto_mesh`; off where the search doesn't run: a CPU,
            `$KERAS_HUB_AUTODIST_SEARCH=0`).
        **kwargs: passed to `cls.from_preset` (`dtype`, `load_weights`, …).

    Returns:
        The model; its `fit`, `generate`, `enable_lora`, … run inside its
        own distribution.

    Example:
    ```python
    lm = keras_hub_autodist.from_preset(
        keras_hub.models.GemmaCausalLM, "./gemma_2b",
        device_mesh={"batch": 2, "model": 4})
    ```
    """
    for name in sorted(set(kwargs) & set(PLAN_ONLY_KEYWORDS)):
        raise ArgumentError(
            f"`{name}=` is an option of `keras_hub_autodist.plan()` (the "
            f"memory answer), not of `from_preset`: {PLAN_ONLY_KEYWORDS[name]}. "
            f"Received: {name}={kwargs[name]!r}"
        )
    # `remat="auto"` is the search's to choose: handled before it is checked.
    remat, search_remat = split_auto_remat(device_mesh, remat)
    options = PlanOptions(
        strategy=strategy,
        batch_axis=batch_axis,
        model_axis=model_axis,
        context_axis=context_axis,
        context_parallel_strategy=context_parallel_strategy,
        dtype=kwargs.get("dtype"),
        sequence_parallel=sequence_parallel,
        strict=strict,
        remat=remat,
    )
    # The progress switch, `$KERAS_HUB_AUTODIST_PROGRESS` included, is read
    # before planning: a bad value fails before any work.
    progress = progress_enabled(progress_option(progress))
    require_jax_backend()
    load_from_preset = original_from_preset(cls)
    planning_started = time.perf_counter()
    # Planning builds models of its own (abstract, or compiled for the
    # search): the user's random streams are left as they were, so that
    # the model loaded below draws the seeds keras-hub's own load would.
    with global_random_kept():
        # 1-2. The config, and every weight of the model it builds.
        preset_config = read_preset_config(preset)
        weights = model_weights(preset_config, options)
        # 3. The mesh, resolved once over the devices, and the plan on it.
        devices = keras.distribution.list_devices()
        # On accelerators the layout search knows, "auto" is its winner.
        device_mesh, options, searched = searched_layout(
            preset, device_mesh, options, devices, search_remat=search_remat
        )
        resolved = resolve_mesh(device_mesh, weights, options, devices=devices)
        if searched:
            resolved = dataclasses.replace(resolved, reason=searched)
        layout_plan = plan_model(weights, resolved, options)
    mesh = resolved.build()
    plan_seconds = time.perf_counter() - planning_started
    distribution = plan_distribution(layout_plan, mesh)
    # 4-5. Load inside the distribution, each weight checked as it is made;
    # then the built model checked against the plan.
    check = WeightCheck(layout_plan, strict=options.strict)

    def load(source):
        loading = sharded_loading(
            load_weights=kwargs.get("load_weights", True),
            total_weights=len(layout_plan.rows),
            total_bytes=layout_plan.total_bytes,
            progress=progress,
            check_variable=check.created,
        )
        with distribution.scope(), remat_scope(options.remat), loading as stats:
            try:
                model = load_from_preset(cls, source, **kwargs)
            except ValueError as error:
                if isinstance(error, AutodistError) or not is_quantized(
                    preset_config.config
                ):
                    raise
                raise _quantized_preset_error(preset, error) from error
        rematerialize_blocks(model, layout_plan)
        attention_through_xla(model, layout_plan)
        install_per_device_attention(model, layout_plan)
        verifying_started = time.perf_counter()
        check.built(model.weights)
        verify_layouts(model)
        stats.verify_seconds = time.perf_counter() - verifying_started
        stats.plan_seconds = plan_seconds
        stats.build_seconds = max(
            0.0, stats.seconds - stats.read_seconds - stats.transfer_seconds
        )
        attach_load_stats(model, stats)
        return model

    try:
        model = load(preset)
    except Exception as error:
        snapshot = cached_kaggle_snapshot(preset) if is_network_error(error) else None
        if snapshot is None:
            raise
        warn(
            f"keras_hub_autodist: the network is unreachable; loading {preset} "
            f"from kagglehub's cache at {snapshot}.",
        )
        model = load(snapshot)
    # 6. Bound to its distribution, and one line on what was done.
    model = bind(model, distribution, layout_plan)
    print_summary(layout_plan)
    return model


def _quantized_preset_error(preset, error: ValueError) -> PresetError:
    return PresetError(
        "keras-hub could not load the weights of this quantized preset "
        "(keras-hub 0.32 can't reload a quantized backbone saved with "
        "`save_to_preset`, on one device either). Load the unquantized preset "
        'with `device_mesh=` and call `quantize("int8")` on the loaded model '
        f"instead. Received: preset={preset!r} ({str(error).splitlines()[0]})"
    )
