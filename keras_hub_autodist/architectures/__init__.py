"""Per-family weight tables: weight path → shape and logical axes.

Each module here describes one family of keras-hub backbones from its config
alone; no mesh logic lives here. Handlers are registered through the
`keras_hub_autodist.architectures` entry-point group (see `pyproject.toml`),
the built-ins exactly like third-party ones.
"""

from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import WeightSpec

__all__ = ["Architecture", "WeightSpec"]
