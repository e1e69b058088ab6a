"""Startup hook of keras-hub-autodist, imported by `keras_hub_autodist.pth`.

It costs well under a millisecond: it only puts a finder on `sys.meta_path`
that waits for `keras_hub` to be imported, then adds `device_mesh=` to its
`from_preset` (see `keras_hub_autodist.activation`). Any failure becomes a
warning at the import of keras_hub; `KERAS_HUB_AUTODIST=0` switches it off.
"""

import os
import sys


def _activate():
    try:
        from keras_hub_autodist.activation import activate

        activate()
    except Exception as error:  # never break the user's import of keras_hub
        import warnings

        warnings.warn(
            "keras-hub-autodist could not add `device_mesh=` to "
            f"keras_hub's from_preset: {type(error).__name__}: {error}. "
            "Set KERAS_HUB_AUTODIST=0 to silence this.",
            stacklevel=2,
        )


class _Loader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _activate()

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
    if os.environ.get("KERAS_HUB_AUTODIST", "1").strip() in ("0", "false", "False"):
        return
    if "keras_hub" in sys.modules:
        _activate()
    elif not any(isinstance(f, _KerasHubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KerasHubFinder())


try:
    install()
except Exception:  # never break interpreter start-up
    pass
