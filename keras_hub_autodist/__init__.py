"""Config-aware distribution for keras-hub language models.

Example:
```python
import keras, keras_hub, keras_hub_autodist

print(keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4}))
mesh = {"batch": 2, "model": 4}
lm = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b", device_mesh=mesh)
```

Importing the package is cheap: it imports neither Keras, keras-hub nor JAX.
It switches the plugin on (`activate()`, which adds `device_mesh=` to
keras-hub's `from_preset`) right away when keras-hub is already imported, and
otherwise the moment keras-hub is imported (`on_import.when_imported`);
before that no `from_preset` exists to change. `Binding`, `distribution_of`,
`from_preset`, `activate` and `deactivate` are loaded on first use (PEP 562).
"""

import importlib
import os

# The package distributes with JAX only: when nothing chose a backend yet
# (keras not imported, KERAS_BACKEND unset), choose JAX. No effect otherwise.
os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_hub_autodist import quiet  # noqa: E402

# TensorFlow's C++ start-up notices (keras-hub imports TensorFlow), JAX's
# start of backends without a device here, and Orbax's warning of every
# single-process checkpoint save kept off stderr.
quiet.quiet_tensorflow_start()
quiet.quiet_jax_cuda_plugin_start()
quiet.quiet_jax_tpu_backend_start()
quiet.quiet_orbax_merge_notice()

from keras_hub_autodist import moved_modules  # noqa: E402

# The former names of modules that moved to another stage
# (`keras_hub_autodist.step_memory`, `keras_hub_autodist.planning.*`,
# `keras_hub_autodist.fitting.*`), served as modules and as attributes.
moved_modules.install()

from keras_hub_autodist.architectures.weight import Weight  # noqa: E402
from keras_hub_autodist.errors import ArgumentError  # noqa: E402
from keras_hub_autodist.errors import AutodistError  # noqa: E402
from keras_hub_autodist.errors import BackendError  # noqa: E402
from keras_hub_autodist.errors import BatchSizeError  # noqa: E402
from keras_hub_autodist.errors import CheckpointOptionError  # noqa: E402
from keras_hub_autodist.errors import CompilerMissingError  # noqa: E402
from keras_hub_autodist.errors import ConfigError  # noqa: E402
from keras_hub_autodist.errors import DemoError  # noqa: E402
from keras_hub_autodist.errors import DeviceMeshTypeError  # noqa: E402
from keras_hub_autodist.errors import DTypeError  # noqa: E402
from keras_hub_autodist.errors import ExtraMissingError  # noqa: E402
from keras_hub_autodist.errors import KeptAttentionWarning  # noqa: E402
from keras_hub_autodist.errors import LayoutMismatchError  # noqa: E402
from keras_hub_autodist.errors import MeshError  # noqa: E402
from keras_hub_autodist.errors import ModelClassError  # noqa: E402
from keras_hub_autodist.errors import MultiprocessSaveError  # noqa: E402
from keras_hub_autodist.errors import NotBoundError  # noqa: E402
from keras_hub_autodist.errors import OutOfVocabularyLabelWarning  # noqa: E402
from keras_hub_autodist.errors import PaddingWarning  # noqa: E402
from keras_hub_autodist.errors import PlanError  # noqa: E402
from keras_hub_autodist.errors import PlanInputError  # noqa: E402
from keras_hub_autodist.errors import PluginOffError  # noqa: E402
from keras_hub_autodist.errors import PresetError  # noqa: E402
from keras_hub_autodist.errors import RestoreError  # noqa: E402
from keras_hub_autodist.errors import SaveTargetError  # noqa: E402
from keras_hub_autodist.errors import SequenceLengthError  # noqa: E402
from keras_hub_autodist.errors import StateLostError  # noqa: E402
from keras_hub_autodist.errors import StrategyError  # noqa: E402
from keras_hub_autodist.errors import TargetCompileError  # noqa: E402
from keras_hub_autodist.errors import UnplannedWeightError  # noqa: E402
from keras_hub_autodist.errors import UnplannedWeightWarning  # noqa: E402
from keras_hub_autodist.errors import UnsupportedArchitectureError  # noqa: E402
from keras_hub_autodist.errors import WeightFileChangedError  # noqa: E402
from keras_hub_autodist.errors import WeightShapeError  # noqa: E402
from keras_hub_autodist.fitting import advice  # noqa: E402, F401  (its adviser)
from keras_hub_autodist.fitting.layout_plan import LayoutPlan  # noqa: E402
from keras_hub_autodist.fitting.planner import get_layout_map  # noqa: E402
from keras_hub_autodist.fitting.planner import plan  # noqa: E402
from keras_hub_autodist.on_import import when_imported  # noqa: E402

__version__ = "0.1.0"

# Public names that need Keras, loaded on first access.
_LAZY = {
    "activate": "keras_hub_autodist.plugin",
    "deactivate": "keras_hub_autodist.plugin",
    "from_preset": "keras_hub_autodist.pipeline",
    "Binding": "keras_hub_autodist.training.binding",
    "distribution_of": "keras_hub_autodist.training.binding",
    "LoadStats": "keras_hub_autodist.loading.session",
    "load_stats": "keras_hub_autodist.loading.session",
    "ResumableCheckpoint": "keras_hub_autodist.training.resumable",
    "compiled_memory": "keras_hub_autodist.fitting.compiled_step",
    "CompiledMemory": "keras_hub_autodist.fitting.compiled_step",
    "summary": "keras_hub_autodist.summary_line",
    "search": "keras_hub_autodist.searching.search",
    "SearchResult": "keras_hub_autodist.searching.search",
}

__all__ = [
    "activate",
    "ArgumentError",
    "AutodistError",
    "BackendError",
    "BatchSizeError",
    "Binding",
    "CheckpointOptionError",
    "compiled_memory",
    "CompiledMemory",
    "ConfigError",
    "deactivate",
    "DemoError",
    "DeviceMeshTypeError",
    "distribution_of",
    "DTypeError",
    "ExtraMissingError",
    "from_preset",
    "get_layout_map",
    "KeptAttentionWarning",
    "LayoutMismatchError",
    "LayoutPlan",
    "load_stats",
    "LoadStats",
    "MeshError",
    "ModelClassError",
    "MultiprocessSaveError",
    "NotBoundError",
    "OutOfVocabularyLabelWarning",
    "PaddingWarning",
    "plan",
    "PlanError",
    "PlanInputError",
    "CompilerMissingError",
    "PluginOffError",
    "PresetError",
    "RestoreError",
    "ResumableCheckpoint",
    "SaveTargetError",
    "search",
    "SearchResult",
    "SequenceLengthError",
    "TargetCompileError",
    "StateLostError",
    "StrategyError",
    "summary",
    "UnplannedWeightError",
    "UnplannedWeightWarning",
    "UnsupportedArchitectureError",
    "Weight",
    "WeightFileChangedError",
    "WeightShapeError",
    "__version__",
]


# Former names, kept for one release.
_DEPRECATED = {"PlanRow": "Weight"}


def __getattr__(name):
    if name in _DEPRECATED:
        from keras_hub_autodist.errors import warn

        warn(
            f"`keras_hub_autodist.{name}` is deprecated; use "
            f"`keras_hub_autodist.{_DEPRECATED[name]}`.",
            DeprecationWarning,
        )
        return globals()[_DEPRECATED[name]]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _activate() -> None:
    from keras_hub_autodist.plugin import activate

    activate()


when_imported("keras_hub", "keras_hub_autodist.activate", _activate)
