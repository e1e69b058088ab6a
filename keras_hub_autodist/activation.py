"""Give `from_preset` a `device_mesh=` keyword, and the functional form.

`activate()` wraps `keras_hub.models.Backbone.from_preset` and
`keras_hub.models.Task.from_preset` (so every subclass, and calls on base
classes such as `CausalLM.from_preset`). Without `device_mesh` the original
runs unchanged. It is idempotent. The startup hook installed with the package
calls it when `keras_hub` is first imported, unless `KERAS_HUB_AUTODIST` is
switched off (then the hook installs a guard that rejects `device_mesh=`);
`import keras_hub_autodist` calls it whatever the environment says.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings

import keras

from keras_hub_autodist import errors
from keras_hub_autodist.binding import bind
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import BackendError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import ModelClassError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.loading import attach_load_stats
from keras_hub_autodist.loading import sharded_loading
from keras_hub_autodist.loading import verify_layouts
from keras_hub_autodist.mesh import build_device_mesh
from keras_hub_autodist.plan import LayoutPlan
from keras_hub_autodist.plan import plan_config
from keras_hub_autodist.plan import resolve_auto_mesh
from keras_hub_autodist.presets import cached_kaggle_snapshot
from keras_hub_autodist.presets import is_network_error
from keras_hub_autodist.presets import is_quantized
from keras_hub_autodist.presets import read_preset_config

# Shared with the startup hook (startup/keras_hub_autodist_hook.py).
_ORIGINAL_ATTR = "__keras_hub_autodist_original__"
_GUARD_ATTR = "__keras_hub_autodist_guard__"

# The startup hook may have loaded errors.py on its own (to raise
# PluginOffError without activating the plugin); the package then shares that
# module, and it must be the package's attribute too.
sys.modules[__package__].errors = errors

DEVICE_MESH_DOC = """
        Distribution (added by keras-hub-autodist):
            device_mesh: a `keras.distribution.DeviceMesh`, a mapping such as
                `{"batch": 2, "model": 4}`, or `"auto"`. The preset's config
                is planned first and the model is built and loaded already
                sharded, then bound to its distribution.
            strategy: `"auto"` (default), `"tp"` or `"fsdp"`.
            batch_axis: mesh axis of the batch, if not `batch`/`data`.
            model_axis: mesh axis of the weights, if not `model`/`tensor`.
            progress: show a progress bar while loading (default: on a
                terminal, unless `KERAS_HUB_AUTODIST_PROGRESS=0`).
            strict: `True` (default): a weight that no layout rule matches
                is an error; `False`: a warning, the weight is replicated.
            sequence_parallel: shard residual-stream activations on the
                sequence over the model axis (default `False`).
"""


def require_jax_backend() -> None:
    """Raise `BackendError` unless Keras runs on JAX."""
    backend = keras.config.backend()
    if backend != "jax":
        raise BackendError(
            "keras_hub_autodist distributes models with JAX sharding; set "
            "KERAS_BACKEND=jax before importing keras. Received: "
            f"backend={backend!r}"
        )


def _distribution_for(layout_plan: LayoutPlan, mesh):
    return keras.distribution.ModelParallel(
        layout_map=layout_plan.layout_map(mesh),
        batch_dim_name=layout_plan.batch_axis,
        # Each process feeds its process-local batch (see docs/multihost.md).
        auto_shard_dataset=False,
    )


def from_preset(
    cls,
    preset: str,
    *,
    device_mesh,
    strategy: str = "auto",
    batch_axis: str | None = None,
    model_axis: str | None = None,
    progress: bool | None = None,
    strict: bool = True,
    sequence_parallel: bool = False,
    **kwargs,
):
    """Load `cls` from `preset`, laid out on `device_mesh` and bound to it.

    Each weight goes straight into its shards: no device ever holds more
    than its final share plus one weight's shard, and the host at most one
    weight's slices (see `keras_hub_autodist.loading`).

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
        progress: show a progress bar while loading; by default on a
            terminal, unless `$KERAS_HUB_AUTODIST_PROGRESS=0`.
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
    require_jax_backend()
    original = _original_from_preset(cls)
    preset_config = read_preset_config(preset)
    dtype = kwargs.get("dtype")
    if isinstance(device_mesh, str):
        device_mesh, _, _ = resolve_auto_mesh(preset_config, device_mesh, dtype=dtype)
    mesh = build_device_mesh(device_mesh)  # validates before listing devices
    layout_plan = plan_config(
        preset_config,
        mesh,
        strategy=strategy,
        batch_axis=batch_axis,
        model_axis=model_axis,
        dtype=dtype,
        sequence_parallel=sequence_parallel,
        strict=strict,
    )
    check = layout_plan.weight_check(strict=strict)
    distribution = _distribution_for(layout_plan, mesh)

    def load(source):
        loading = sharded_loading(
            load_weights=kwargs.get("load_weights", True),
            total_weights=len(layout_plan.rows),
            total_bytes=layout_plan.total_bytes,
            progress=progress,
            check_variable=check.created,
        )
        with distribution.scope(), loading as stats:
            try:
                model = original(cls, source, **kwargs)
            except ValueError as error:
                if isinstance(error, AutodistError):
                    raise
                if is_quantized(preset_config.config):
                    raise PresetError(
                        "keras-hub could not load the weights of this "
                        "quantized preset (keras-hub 0.32 can't reload a "
                        "quantized backbone saved with `save_to_preset`, on "
                        "one device either). Load the unquantized preset "
                        'with `device_mesh=` and call `quantize("int8")` on '
                        f"the loaded model instead. Received: preset={preset!r}"
                        f" ({str(error).splitlines()[0]})"
                    ) from error
                raise
        check.built(model.weights)
        verify_layouts(model)
        attach_load_stats(model, stats)
        return model

    try:
        model = load(preset)
    except Exception as error:
        snapshot = cached_kaggle_snapshot(preset) if is_network_error(error) else None
        if snapshot is None:
            raise
        warnings.warn(
            f"keras_hub_autodist: the network is unreachable; loading {preset} "
            f"from kagglehub's cache at {snapshot}.",
            stacklevel=2,
        )
        model = load(snapshot)
    return bind(model, distribution, layout_plan)


def _original_from_preset(cls):
    for klass in cls.__mro__:
        method = klass.__dict__.get("from_preset")
        if method is not None:
            func = method.__func__
            return getattr(func, _ORIGINAL_ATTR, func)
    raise ModelClassError(
        f"{getattr(cls, '__name__', cls)} has no from_preset. Pass a keras-hub "
        f"Backbone or Task class. Received: cls={cls!r}"
    )


def _keywords_of(original, cls, preset, args, kwargs):
    """`args` and `kwargs` as keywords, rejected as `original` would reject them.

    keras-hub 0.32's `from_preset(cls, preset, load_weights=True, **kwargs)`
    takes one positional argument after `preset`.
    """
    signature = inspect.signature(original)
    try:
        signature.bind(cls, preset, *args, **kwargs)
    except TypeError as error:
        raise ArgumentError(
            f"{cls.__name__}.from_preset{signature}: {error}. Pass options as "
            f"keywords, e.g. load_weights=False. Received: args={args!r}, "
            f"keywords={sorted(kwargs)}"
        ) from None
    names = [
        p.name
        for p in list(signature.parameters.values())[2:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return {**kwargs, **dict(zip(names, args))}


def _with_device_mesh(original):
    @functools.wraps(original)
    def from_preset_with_mesh(
        cls,
        preset,
        *args,
        device_mesh=None,
        strategy=None,
        batch_axis=None,
        model_axis=None,
        progress=None,
        strict=None,
        sequence_parallel=None,
        **kwargs,
    ):
        if device_mesh is None:
            given = {
                k: v
                for k, v in dict(
                    strategy=strategy,
                    batch_axis=batch_axis,
                    model_axis=model_axis,
                    progress=progress,
                    strict=strict,
                    sequence_parallel=sequence_parallel,
                ).items()
                if v is not None
            }
            if given:
                raise MeshError(
                    f"{', '.join(f'{k}=' for k in given)} only apply with "
                    "`device_mesh=`; pass a mesh, e.g. device_mesh={'batch': "
                    f"2, 'model': 4}}. Received: {given} without device_mesh"
                )
            return original(cls, preset, *args, **kwargs)
        if args or kwargs:
            kwargs = _keywords_of(original, cls, preset, args, kwargs)
        return from_preset(
            cls,
            preset,
            device_mesh=device_mesh,
            strategy="auto" if strategy is None else strategy,
            batch_axis=batch_axis,
            model_axis=model_axis,
            progress=progress,
            strict=True if strict is None else strict,
            sequence_parallel=False if sequence_parallel is None else sequence_parallel,
            **kwargs,
        )

    setattr(from_preset_with_mesh, _ORIGINAL_ATTR, original)
    from_preset_with_mesh.__doc__ = (original.__doc__ or "") + DEVICE_MESH_DOC
    return from_preset_with_mesh


def activate() -> bool:
    """Add `device_mesh=` to keras-hub's `from_preset`; idempotent.

    Runs whatever `KERAS_HUB_AUTODIST` says: that switch only stops the
    startup hook. A guard the hook left (see the hook's docstring) is
    replaced.

    Returns:
        True: `from_preset` now takes `device_mesh=`.

    Example:
    ```python
    import keras_hub_autodist  # calls activate()
    ```
    """
    import keras_hub

    for base in (keras_hub.models.Backbone, keras_hub.models.Task):
        func = base.__dict__["from_preset"].__func__
        original = getattr(func, _ORIGINAL_ATTR, None)
        if original is None or getattr(func, _GUARD_ATTR, False):
            base.from_preset = classmethod(_with_device_mesh(original or func))
    return True


def deactivate() -> None:
    """Restore keras-hub's original `from_preset` methods."""
    import keras_hub

    for base in (keras_hub.models.Backbone, keras_hub.models.Task):
        func = base.__dict__["from_preset"].__func__
        original = getattr(func, _ORIGINAL_ATTR, None)
        if original is not None:
            base.from_preset = classmethod(original)


__all__ = ["activate", "deactivate", "from_preset"]
