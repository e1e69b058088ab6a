"""Startup hook of keras-hub-autodist, imported by `keras_hub_autodist.pth`.

It costs well under a millisecond: it only puts a finder on `sys.meta_path`
that waits for `keras_hub` to be imported, then adds `device_mesh=` to its
`from_preset` (see `keras_hub_autodist.activation`).

`KERAS_HUB_AUTODIST` set to a false value (`0`, `false`, `no`, `off`, ...,
any case) switches the automatic start off. keras-hub's `from_preset` then
gets a guard instead, which passes every call through unchanged except those
with `device_mesh=` (or `strategy=`, `batch_axis=`, `model_axis=`): keras-hub
would silently ignore them, the guard raises `PluginOffError`. An explicit
`import keras_hub_autodist` turns the plugin on whatever the environment says.
The guard is also what is left when the plugin fails to load.

Under `python -S` (no `.pth` files), nothing of keras-hub-autodist runs until
it is imported.
"""

import os
import sys

SWITCH_ENV = "KERAS_HUB_AUTODIST"
# Spellings of "off" for `KERAS_HUB_AUTODIST` (compared case-insensitively).
OFF_VALUES = frozenset({"0", "false", "f", "no", "n", "off", "disable", "disabled"})
# Keywords that only `keras_hub_autodist` understands.
MESH_KEYWORDS = ("device_mesh", "strategy", "batch_axis", "model_axis")
ORIGINAL_ATTR = "__keras_hub_autodist_original__"
GUARD_ATTR = "__keras_hub_autodist_guard__"


def switched_off(environ=None) -> bool:
    """True when `KERAS_HUB_AUTODIST` holds a false value (`0`, `off`, `no`...)."""
    environ = os.environ if environ is None else environ
    return environ.get(SWITCH_ENV, "").strip().lower() in OFF_VALUES


def _load_errors():
    """`keras_hub_autodist.errors`, without importing (so activating) the package.

    errors.py imports nothing; it is loaded under its own name, so that the
    package imported later shares its classes.
    """
    module = sys.modules.get("keras_hub_autodist.errors")
    if module is not None:
        return module
    import importlib.util

    package = importlib.util.find_spec("keras_hub_autodist")
    path = os.path.join(list(package.submodule_search_locations)[0], "errors.py")
    spec = importlib.util.spec_from_file_location("keras_hub_autodist.errors", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def _plugin_off_error(message):
    try:
        error_class = _load_errors().PluginOffError
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


def install_guard(keras_hub, reason):
    """Put `guard` on `Backbone`/`Task.from_preset` unless already wrapped."""
    for base in (keras_hub.models.Backbone, keras_hub.models.Task):
        func = base.__dict__["from_preset"].__func__
        if getattr(func, ORIGINAL_ATTR, None) is None:
            base.from_preset = classmethod(guard(func, reason))


def _off_reason():
    return (
        f"{SWITCH_ENV}={os.environ.get(SWITCH_ENV)!r} switched its automatic start off"
    )


def _activate():
    try:
        from keras_hub_autodist.activation import activate

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
    if switched_off():
        try:
            install_guard(sys.modules["keras_hub"], _off_reason())
        except Exception:  # never break the user's import of keras_hub
            pass
    else:
        _activate()


class _Loader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _on_keras_hub()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _KerasHubFinder:
    """Waits for the first `import keras_hub`, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras_hub":
            return None
        try:
            sys.meta_path.remove(self)
            from importlib.machinery import PathFinder

            spec = PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec
        except Exception:
            return None


def install():
    """Act on `keras_hub` now if imported, else when it is first imported."""
    if "keras_hub" in sys.modules:
        _on_keras_hub()
    elif not any(isinstance(f, _KerasHubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KerasHubFinder())


try:
    install()
except Exception:  # never break interpreter start-up
    pass
