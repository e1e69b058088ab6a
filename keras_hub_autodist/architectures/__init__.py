"""Per-family rule tables: weight path pattern → logical axes.

Each module here describes one family of keras-hub backbones; shapes come
from the model and no mesh logic lives here. The built-ins are registered in
code (`registry.BUILTIN_ARCHITECTURES`) and loaded exactly like third-party
architectures, which come through the `keras_hub_autodist.architectures`
entry-point group.
"""

from keras_hub_autodist.architectures.base import Architecture

__all__ = ["Architecture"]
