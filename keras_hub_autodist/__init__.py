"""Config-aware distribution for keras-hub language models.

Example:
```python
import keras, keras_hub, keras_hub_autodist

print(keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4}))
mesh = {"batch": 2, "model": 4}
lm = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b", device_mesh=mesh)
```
"""

from keras_hub_autodist.activation import activate
from keras_hub_autodist.activation import from_preset
from keras_hub_autodist.binding import Binding
from keras_hub_autodist.binding import distribution_of
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import BackendError
from keras_hub_autodist.errors import BatchSizeError
from keras_hub_autodist.errors import DeviceMeshTypeError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.plan import LayoutPlan
from keras_hub_autodist.plan import get_layout_map
from keras_hub_autodist.plan import plan

__version__ = "0.1.0"

__all__ = [
    "AutodistError",
    "Binding",
    "BackendError",
    "BatchSizeError",
    "DeviceMeshTypeError",
    "LayoutPlan",
    "MeshError",
    "PresetError",
    "StrategyError",
    "UnsupportedArchitectureError",
    "__version__",
    "activate",
    "distribution_of",
    "from_preset",
    "get_layout_map",
    "plan",
]

activate()
