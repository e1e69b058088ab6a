"""Config-aware distribution for keras-hub language models.

Example:
```python
import keras, keras_hub, keras_hub_autodist

print(keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4}))
mesh = {"batch": 2, "model": 4}
lm = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b", device_mesh=mesh)
```

Importing the package is cheap: it imports neither Keras, keras-hub nor JAX.
It activates the plugin (`activate()`, which adds `device_mesh=` to
keras-hub's `from_preset`) right away when keras-hub is already imported, and
otherwise the moment keras-hub is imported; before that no `from_preset`
exists to change. `Binding`, `distribution_of`, `from_preset` and `activate`
are loaded on first use (PEP 562).
"""

import importlib
import os
import sys

# The package distributes with JAX only: when nothing chose a backend yet
# (keras not imported, KERAS_BACKEND unset), choose JAX. No effect otherwise.
os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_hub_autodist.errors import ArgumentError  # noqa: E402
from keras_hub_autodist.errors import AutodistError  # noqa: E402
from keras_hub_autodist.errors import BackendError  # noqa: E402
from keras_hub_autodist.errors import BatchSizeError  # noqa: E402
from keras_hub_autodist.errors import ConfigError  # noqa: E402
from keras_hub_autodist.errors import DeviceMeshTypeError  # noqa: E402
from keras_hub_autodist.errors import DTypeError  # noqa: E402
from keras_hub_autodist.errors import LayoutMismatchError  # noqa: E402
from keras_hub_autodist.errors import MeshError  # noqa: E402
from keras_hub_autodist.errors import ModelClassError  # noqa: E402
from keras_hub_autodist.errors import NotBoundError  # noqa: E402
from keras_hub_autodist.errors import PlanError  # noqa: E402
from keras_hub_autodist.errors import PlanInputError  # noqa: E402
from keras_hub_autodist.errors import PluginOffError  # noqa: E402
from keras_hub_autodist.errors import PresetError  # noqa: E402
from keras_hub_autodist.errors import RestoreError  # noqa: E402
from keras_hub_autodist.errors import SaveTargetError  # noqa: E402
from keras_hub_autodist.errors import StrategyError  # noqa: E402
from keras_hub_autodist.errors import UnplannedWeightError  # noqa: E402
from keras_hub_autodist.errors import UnplannedWeightWarning  # noqa: E402
from keras_hub_autodist.errors import UnsupportedArchitectureError  # noqa: E402
from keras_hub_autodist.errors import WeightShapeError  # noqa: E402

# `plan` is imported eagerly (it is light): the function must shadow the
# submodule of the same name, which a lazy import would not do.
from keras_hub_autodist.plan import LayoutPlan  # noqa: E402
from keras_hub_autodist.plan import get_layout_map  # noqa: E402
from keras_hub_autodist.plan import plan  # noqa: E402

__version__ = "0.1.0"

# Public names that need Keras, loaded on first access.
_LAZY = {
    "activate": "keras_hub_autodist.activation",
    "from_preset": "keras_hub_autodist.activation",
    "Binding": "keras_hub_autodist.binding",
    "distribution_of": "keras_hub_autodist.binding",
    "LoadStats": "keras_hub_autodist.loading",
    "load_stats": "keras_hub_autodist.loading",
    "ResumableCheckpoint": "keras_hub_autodist.checkpointing",
}

__all__ = [
    "activate",
    "ArgumentError",
    "AutodistError",
    "BackendError",
    "BatchSizeError",
    "Binding",
    "ConfigError",
    "DeviceMeshTypeError",
    "distribution_of",
    "DTypeError",
    "from_preset",
    "get_layout_map",
    "LayoutMismatchError",
    "LayoutPlan",
    "load_stats",
    "LoadStats",
    "MeshError",
    "ModelClassError",
    "NotBoundError",
    "plan",
    "PlanError",
    "PlanInputError",
    "PluginOffError",
    "PresetError",
    "RestoreError",
    "ResumableCheckpoint",
    "SaveTargetError",
    "StrategyError",
    "UnplannedWeightError",
    "UnplannedWeightWarning",
    "UnsupportedArchitectureError",
    "WeightShapeError",
    "__version__",
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _activate() -> None:
    from keras_hub_autodist.activation import activate

    activate()


class _ActivatingLoader:
    """Runs keras-hub's own loader, then activates the plugin."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _activate()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _ActivateWithKerasHub:
    """A `sys.meta_path` finder that waits for `import keras_hub`, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras_hub":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, path, target) if find_spec else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ActivatingLoader(spec.loader)
                return spec
        return None


def _activate_now_or_with_keras_hub() -> None:
    if "keras_hub" in sys.modules:
        _activate()
    elif not any(isinstance(f, _ActivateWithKerasHub) for f in sys.meta_path):
        sys.meta_path.insert(0, _ActivateWithKerasHub())


_activate_now_or_with_keras_hub()
