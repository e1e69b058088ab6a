"""Errors raised by `keras_hub_autodist`.

Every error says what it received and how to fix it. All of them derive from
`AutodistError`, and from `ValueError` or `TypeError` so that existing
`except ValueError` blocks keep working.
"""


class AutodistError(Exception):
    """Base class of every error raised by `keras_hub_autodist`."""


class MeshError(AutodistError, ValueError):
    """The device mesh (or its axis roles) can't be used for this model."""


class StrategyError(AutodistError, ValueError):
    """An unknown sharding strategy was requested."""


class PresetError(AutodistError, ValueError):
    """The preset can't be read (missing, or without `config.json`)."""


class UnsupportedArchitectureError(AutodistError, ValueError):
    """No layout handler is registered for the preset's backbone class."""


class BackendError(AutodistError, ValueError):
    """Distribution needs the JAX backend of Keras."""


class BatchSizeError(AutodistError, ValueError):
    """A batch does not divide evenly over the batch axis of the mesh."""


class DeviceMeshTypeError(AutodistError, TypeError):
    """`device_mesh` is of a type that can't describe a mesh."""


class PluginOffError(AutodistError, TypeError):
    """`device_mesh=` was passed while keras-hub-autodist is not active."""


class ArgumentError(AutodistError, TypeError):
    """`from_preset` received arguments keras-hub's own would reject."""


class ModelClassError(AutodistError, TypeError):
    """A class without keras-hub's `from_preset` was passed."""


class NotBoundError(AutodistError, ValueError):
    """The model was not loaded with `device_mesh=`."""
