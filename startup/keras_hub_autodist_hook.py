"""Startup hook of keras-hub-autodist, imported by `keras_hub_autodist.pth`.

It costs well under a millisecond: it only registers, with the package's one
import finder (`keras_hub_autodist/on_import.py`), a callback that waits
for `keras_hub` to be imported, then adds `device_mesh=` to its
`from_preset` (see `keras_hub_autodist.plugin`).

`KERAS_HUB_AUTODIST` set to a false value (`0`, `false`, `no`, `off`, ...,
any case) switches the automatic start off. keras-hub's `from_preset` then
gets a guard instead, which passes every call through unchanged except those
with `device_mesh=` (or another of `MESH_KEYWORDS`): keras-hub
would silently ignore them, the guard raises `PluginOffError`. A value that
is neither on nor off (a typo) gets the guard too, with a warning, and the
guard's error names the value and the accepted spellings. An explicit
`import keras_hub_autodist` turns the plugin on whatever the environment says.
The guard is also what is left when the plugin fails to load.

The spellings are those of the package's one parser of switches
(`keras_hub_autodist/environment.py`); this hook can't import the package, so
it keeps a copy, which tests/test_activation.py ties to the parser's.

Under `python -S` (no `.pth` files), nothing of keras-hub-autodist runs until
it is imported.
"""

import os
import sys

SWITCH_ENV = "KERAS_HUB_AUTODIST"
# Spellings of "on" and "off" for `KERAS_HUB_AUTODIST` (compared
# case-insensitively): a copy of `keras_hub_autodist.environment`'s.
ON_VALUES = frozenset({"1", "true", "t", "yes", "y", "on", "enable", "enabled"})
OFF_VALUES = frozenset(
    {"0", "false", "f", "no", "n", "off", "disable", "disabled", "none"}
)
# Keywords that only `keras_hub_autodist` understands.
MESH_KEYWORDS = (
    "device_mesh",
    "strategy",
    "batch_axis",
    "model_axis",
    "context_axis",
    "context_parallel_strategy",
    "remat",
    "progress",
    "strict",
    "sequence_parallel",
)
ORIGINAL_ATTR = "__keras_hub_autodist_original__"
GUARD_ATTR = "__keras_hub_autodist_guard__"


def switched_off(environ=None) -> bool:
    """True when `KERAS_HUB_AUTODIST` holds a false value (`0`, `off`, `no`...)."""
    environ = os.environ if environ is None else environ
    return environ.get(SWITCH_ENV, "").strip().lower() in OFF_VALUES


def unknown_switch(environ=None) -> bool:
    """True when `KERAS_HUB_AUTODIST` is set to neither an on nor an off value."""
    environ = os.environ if environ is None else environ
    value = environ.get(SWITCH_ENV, "").strip().lower()
    return bool(value) and value not in ON_VALUES | OFF_VALUES


def _load_light(name):
    """`keras_hub_autodist.<name>` (standard library only), loaded by path
    without importing (so activating) the package; the package imported
    later shares the module. `name` may be dotted (`compat.steps`). A
    subpackage (`compat`) gets its modules loaded so, as its attributes,
    before its `__init__` runs: its own `from ... import` of them then finds
    them there, where an import would bring in the package itself."""
    full_name = f"keras_hub_autodist.{name}"
    module = sys.modules.get(full_name)
    if module is not None:
        return module
    import importlib.util

    package = importlib.util.find_spec("keras_hub_autodist")
    root = list(package.submodule_search_locations)[0]
    folder = os.path.join(root, *name.split("."))
    if os.path.isdir(folder):
        path, locations = os.path.join(folder, "__init__.py"), [folder]
        children = sorted(
            entry[:-3]
            for entry in os.listdir(folder)
            if entry.endswith(".py") and entry != "__init__.py"
        )
    else:
        path, locations, children = f"{folder}.py", None, []
    spec = importlib.util.spec_from_file_location(
        full_name, path, submodule_search_locations=locations
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        for child in children:
            setattr(module, child, _load_light(f"{name}.{child}"))
        spec.loader.exec_module(module)
    except BaseException:
        for child in children:
            sys.modules.pop(f"{full_name}.{child}", None)
        del sys.modules[spec.name]
        raise
    return module


def _plugin_off_error(message):
    try:
        error_class = _load_light("errors").PluginOffError
    except Exception:  # a broken install: still an error, and a TypeError
        error_class = TypeError
    return error_class(message)


def guard(original, reason):
    """Wrap keras-hub's `from_preset` to reject `device_mesh=` with `reason`."""

    def from_preset(cls, preset, *args, **kwargs):
        given = {k: kwargs[k] for k in MESH_KEYWORDS if kwargs.get(k) is not None}
        if given:
            received = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise _plugin_off_error(
                f"`{next(iter(given))}=` needs keras-hub-autodist, which is not "
                f"active: {reason}. Run `import keras_hub_autodist` before "
                f"calling from_preset (it turns the plugin on), or unset "
                f"{SWITCH_ENV}. Received: {received}"
            )
        return original(cls, preset, *args, **kwargs)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(from_preset, name, getattr(original, name, None))
    from_preset.__wrapped__ = original
    setattr(from_preset, ORIGINAL_ATTR, original)
    setattr(from_preset, GUARD_ATTR, True)
    return from_preset


# The package's registered patches (`compat.PATCHES`) of `from_preset`.
GUARDED_BASES = {"backbone_from_preset": "Backbone", "task_from_preset": "Task"}


def install_guard(keras_hub, reason):
    """Put `guard` on `Backbone`/`Task.from_preset` unless already wrapped,
    through the package's one patch installer (`compat.set_patch`)."""
    compat = _load_light("compat")
    for patch, name in GUARDED_BASES.items():
        func = getattr(keras_hub.models, name).__dict__["from_preset"].__func__
        if getattr(func, ORIGINAL_ATTR, None) is None:
            compat.set_patch(patch, classmethod(guard(func, reason)))


def _off_reason():
    return (
        f"{SWITCH_ENV}={os.environ.get(SWITCH_ENV)!r} switched its automatic start off"
    )


def _unknown_reason():
    spellings = (
        f"on: {', '.join(sorted(ON_VALUES))}; off: {', '.join(sorted(OFF_VALUES))}"
    )
    return (
        f"{SWITCH_ENV}={os.environ.get(SWITCH_ENV)!r} is neither an on nor an "
        f"off value ({spellings}; any case), so its automatic start was held "
        "back; set one of these"
    )


def _activate():
    try:
        from keras_hub_autodist.plugin import activate

        activate()
    except Exception as error:  # never break the user's import of keras_hub
        import warnings

        reason = f"it failed to load ({type(error).__name__}: {error})"
        warnings.warn(
            "keras-hub-autodist could not add `device_mesh=` to "
            f"keras_hub's from_preset: {type(error).__name__}: {error}. "
            f"Set {SWITCH_ENV}=0 to silence this.",
            stacklevel=2,
        )
        try:
            install_guard(sys.modules["keras_hub"], reason)
        except Exception:
            pass


def _on_keras_hub():
    if switched_off() or unknown_switch():
        reason = _off_reason() if switched_off() else _unknown_reason()
        if unknown_switch():
            import warnings

            warnings.warn(f"keras-hub-autodist: {reason}.", stacklevel=2)
        try:
            install_guard(sys.modules["keras_hub"], reason)
        except Exception:  # never break the user's import of keras_hub
            pass
    else:
        _activate()


def install():
    """Act on `keras_hub` now if imported, else when it is first imported
    (through the package's one import finder, `keras_hub_autodist.on_import`)."""
    _load_light("on_import").when_imported(
        "keras_hub", "keras_hub_autodist_hook", _on_keras_hub
    )


try:
    install()
except Exception:  # never break interpreter start-up
    pass
