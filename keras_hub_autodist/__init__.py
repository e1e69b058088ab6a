"""Config-aware distribution for keras-hub language models.

Example:
```python
import keras, keras_hub, keras_hub_autodist

print(keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4}))
mesh = {"batch": 2, "model": 4}
lm = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b", device_mesh=mesh)
```
"""

import os

# The package distributes with JAX only: when nothing chose a backend yet
# (keras not imported, KERAS_BACKEND unset), choose JAX. No effect otherwise.
os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_hub_autodist.activation import activate  # noqa: E402
from keras_hub_autodist.activation import from_preset  # noqa: E402
from keras_hub_autodist.binding import Binding  # noqa: E402
from keras_hub_autodist.binding import distribution_of  # noqa: E402
from keras_hub_autodist.errors import AutodistError  # noqa: E402
from keras_hub_autodist.errors import BackendError  # noqa: E402
from keras_hub_autodist.errors import BatchSizeError  # noqa: E402
from keras_hub_autodist.errors import DeviceMeshTypeError  # noqa: E402
from keras_hub_autodist.errors import LayoutMismatchError  # noqa: E402
from keras_hub_autodist.errors import MeshError  # noqa: E402
from keras_hub_autodist.errors import PresetError  # noqa: E402
from keras_hub_autodist.errors import StrategyError  # noqa: E402
from keras_hub_autodist.errors import UnsupportedArchitectureError  # noqa: E402
from keras_hub_autodist.loading import LoadStats  # noqa: E402
from keras_hub_autodist.loading import load_stats  # noqa: E402
from keras_hub_autodist.plan import LayoutPlan  # noqa: E402
from keras_hub_autodist.plan import get_layout_map  # noqa: E402
from keras_hub_autodist.plan import plan  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AutodistError",
    "Binding",
    "BackendError",
    "BatchSizeError",
    "DeviceMeshTypeError",
    "LayoutMismatchError",
    "LayoutPlan",
    "LoadStats",
    "MeshError",
    "PresetError",
    "StrategyError",
    "UnsupportedArchitectureError",
    "__version__",
    "activate",
    "distribution_of",
    "from_preset",
    "get_layout_map",
    "load_stats",
    "plan",
]

activate()
