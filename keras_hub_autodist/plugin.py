"""The plugin switch: give keras-hub's `from_preset` a `device_mesh=` keyword.

`activate()` wraps `keras_hub.models.Backbone.from_preset` and
`keras_hub.models.Task.from_preset` (so every subclass, and calls on base
classes such as `CausalLM.from_preset`). Without `device_mesh` the original
runs unchanged, but for the keras-hub bugs the plugin fixes while active
(`compat.upstream`: tied Llama presets save and load). It is idempotent.
The startup hook installed with the package calls it when `keras_hub` is
first imported, unless `KERAS_HUB_AUTODIST` is switched off (then the hook
installs a guard that rejects `device_mesh=`);
importing the package itself calls it whatever the environment says.
"""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap

from keras_hub_autodist import compat
from keras_hub_autodist import errors
from keras_hub_autodist.compat import upstream
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.pipeline import ORIGINAL_ATTR
from keras_hub_autodist.pipeline import from_preset
from keras_hub_autodist.planning.options import DISTRIBUTION_KEYWORDS
from keras_hub_autodist.planning.options import OPTIONS

# Shared with the startup hook (startup/keras_hub_autodist_hook.py).
GUARD_ATTR = "__keras_hub_autodist_guard__"

# The startup hook may have loaded errors.py on its own (to raise
# PluginOffError without activating the plugin); the package then shares that
# module, and it must be the package's attribute too.
sys.modules[__package__].errors = errors

DEVICE_MESH_DOC = (
    "\n        Distribution (added by keras-hub-autodist):\n"
    "            device_mesh: a `keras.distribution.DeviceMesh`, a mapping such\n"
    '                as `{"batch": 2, "model": 4}`, or `"auto"`. The preset\'s\n'
    "                config is planned first and the model is built and loaded\n"
    "                already sharded, then bound to its distribution.\n"
    + "".join(
        textwrap.fill(
            f"{o.name}: {o.doc}",
            width=76,
            initial_indent=" " * 12,
            subsequent_indent=" " * 16,
        )
        + "\n"
        for o in OPTIONS
        if o.from_preset
    )
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
    def from_preset_with_mesh(cls, preset, *args, device_mesh=None, **kwargs):
        ours = {
            name: kwargs.pop(name) for name in DISTRIBUTION_KEYWORDS if name in kwargs
        }
        given = {name: value for name, value in ours.items() if value is not None}
        if device_mesh is None:
            if given:
                raise MeshError(
                    f"{', '.join(f'{k}=' for k in given)} only apply with "
                    "`device_mesh=`; pass a mesh, e.g. device_mesh={'batch': "
                    f"2, 'model': 4}}. Received: {given} without device_mesh"
                )
            return original(cls, preset, *args, **kwargs)
        if args or kwargs:
            kwargs = _keywords_of(original, cls, preset, args, kwargs)
        return from_preset(cls, preset, device_mesh=device_mesh, **given, **kwargs)

    setattr(from_preset_with_mesh, ORIGINAL_ATTR, original)
    from_preset_with_mesh.__doc__ = (original.__doc__ or "") + DEVICE_MESH_DOC
    return from_preset_with_mesh


# The `compat.PATCHES` that add `device_mesh=`, and the class each changes.
_PATCHED_BASES = {"backbone_from_preset": "Backbone", "task_from_preset": "Task"}


def activate() -> bool:
    """Add `device_mesh=` to keras-hub's `from_preset`; idempotent.

    Runs whatever `KERAS_HUB_AUTODIST` says: that switch only stops the
    startup hook. A guard the hook left (see the hook's docstring) is
    replaced.

    Returns:
        True: `from_preset` now takes `device_mesh=`.

    Example:
    ```python
    activate()  # what importing the package already did
    ```
    """
    import keras_hub

    for patch, base in _PATCHED_BASES.items():
        func = getattr(keras_hub.models, base).__dict__["from_preset"].__func__
        original = getattr(func, ORIGINAL_ATTR, None)
        if original is None or getattr(func, GUARD_ATTR, False):
            compat.set_patch(patch, classmethod(_with_device_mesh(original or func)))
    for patch, fixed in upstream.fixes_to_install().items():
        compat.set_patch(patch, fixed)  # the keras-hub bugs the plugin fixes
    return True


def deactivate() -> None:
    """Restore keras-hub's original `from_preset` methods, and remove the
    fixes of its bugs (`compat.upstream`)."""
    import keras_hub

    for patch, original in upstream.originals_to_restore().items():
        compat.set_patch(patch, original)
    for patch, base in _PATCHED_BASES.items():
        func = getattr(keras_hub.models, base).__dict__["from_preset"].__func__
        original = getattr(func, ORIGINAL_ATTR, None)
        if original is not None:
            compat.set_patch(patch, classmethod(original))


__all__ = ["activate", "deactivate"]
