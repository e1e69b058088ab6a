"""The abstract build: a backbone's variables (paths, shapes, dtypes) from its
config, without allocating any of them.

The backbone class itself is built from the config inside
`keras.StatelessScope(initialize_variables=False)`: Keras then defers every
variable's initializer, so no array exists. The variables' paths and shapes
are read, and the model is dropped. Results are cached per backbone class and
config, so re-planning the same preset on another mesh is immediate.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping

from keras_hub_autodist.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VariableShape:
    """One variable of an abstractly built backbone.

    Args:
        path: the Keras variable path, e.g. `"decoder_block_0/attention/query/kernel"`.
        shape: its shape.
        dtype: its dtype, e.g. `"bfloat16"`.

    Example:
    >>> VariableShape("final_norm/scale", (16,), "float32").shape
    (16,)
    """

    path: str
    shape: tuple[int, ...]
    dtype: str


def _config_key(config: Mapping) -> str:
    try:
        return json.dumps(config, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(sorted(config.items(), key=lambda item: str(item[0])))


def model_variables(backbone_cls: type, config: Mapping) -> tuple[VariableShape, ...]:
    """Every variable of `backbone_cls.from_config(config)`, built abstractly.

    Args:
        backbone_cls: a keras-hub `Backbone` subclass.
        config: its constructor arguments (`get_config()`, or a Keras
            preset's `config.json` "config").

    Returns:
        One `VariableShape` per variable, in the model's order.

    Example:
    ```python
    import keras_hub
    variables = model_variables(keras_hub.models.GemmaBackbone, config)
    ```
    """
    config = _serialized(config)
    return _cached_variables(backbone_cls, _config_key(config), _Frozen(config))


def _serialized(config: Mapping) -> dict:
    """Converters hand sub-models over as layer instances (Gemma 3's vision
    encoder); `from_config` and the cache key take them serialized."""
    import keras

    return {
        key: keras.saving.serialize_keras_object(value)
        if isinstance(value, keras.layers.Layer)
        else value
        for key, value in config.items()
    }


class _Frozen:
    """Carries the config through the cache without hashing it."""

    def __init__(self, config):
        self.config = config

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Frozen)


@functools.lru_cache(maxsize=32)
def _cached_variables(backbone_cls, key, frozen) -> tuple[VariableShape, ...]:
    del key  # part of the cache key only
    from keras_hub_autodist.keras_internals import deferred_variables

    config = dict(frozen.config)
    try:
        with deferred_variables():
            backbone = backbone_cls.from_config(config)
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigError(
            f"keras-hub could not build {backbone_cls.__name__} from the "
            f"preset's config: {type(error).__name__}: {error}. Fix the "
            "preset's config.json (or the config dict) so that "
            f"`{backbone_cls.__name__}.from_config(config)` works. Received: "
            f"config keys {sorted(config)}"
        ) from error
    found = tuple(
        VariableShape(v.path, tuple(int(size) for size in v.shape), str(v.dtype))
        for v in backbone.variables
    )
    del backbone
    return found


def clear_cache() -> None:
    """Forget the cached abstract builds."""
    _cached_variables.cache_clear()
