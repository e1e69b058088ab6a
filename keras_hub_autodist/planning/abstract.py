"""The abstract build: a backbone's variables (paths, shapes, dtypes) from its
config, without allocating any of them.

The backbone class itself is built from the config inside
`keras.StatelessScope(initialize_variables=False)`: Keras then defers every
variable's initializer, so no array exists. The variables' paths and shapes
are read, and the model is dropped.

Results are cached per backbone class and config (and Keras' global dtype
policy, for a config that names no dtype): in memory, so re-planning
the same preset on another mesh is immediate, and on disk (`disk_cache.py`),
so a later process, the CLI's included, plans the same config without
importing keras-hub.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping

from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.reading.disk_cache import read_stored
from keras_hub_autodist.reading.disk_cache import store
from keras_hub_autodist.reading.dtypes import global_policy_name

# The disk cache's kind for abstract builds: their weights, without the
# non-weight state earlier entries (kind "variables") listed.
CACHE_KIND = "weights"


def _build_key(config: Mapping) -> tuple[str, bool]:
    """`_config_key`, with Keras' global dtype policy where the config names
    no dtype: the backbone's variables are then built in it (a bfloat16
    global policy makes bfloat16 weights of the same config)."""
    text, plain = _config_key(config)
    if config.get("dtype") is None:
        text = f"{text}|global_dtype_policy={global_policy_name()}"
    return text, plain


def _config_key(config: Mapping) -> tuple[str, bool]:
    """The config as one canonical text, and whether it is plain JSON.

    The text keys the memory cache; with the backbone class name (and the
    keras/keras-hub versions, `_disk_file`) it keys the disk cache too, but
    only when it is plain JSON: a value that is not (a layer, a dtype
    policy) is written as its `repr`, which is fine within this process but
    not a stable name across processes.
    """
    plain = True

    def not_json(value):
        nonlocal plain
        plain = False
        return repr(value)

    try:
        return json.dumps(config, sort_keys=True, default=not_json), plain
    except (TypeError, ValueError):  # keys of mixed types, or a cycle
        return repr(sorted(config.items(), key=lambda item: str(item[0]))), False


def model_variables(backbone_cls: type, config: Mapping) -> tuple[Weight, ...]:
    """Every weight of `backbone_cls.from_config(config)`, built abstractly:
    its variables but for Keras' non-weight state (RNG seeds, metrics),
    which Keras' layout map leaves replicated.

    Args:
        backbone_cls: a keras-hub `Backbone` subclass.
        config: its constructor arguments (`get_config()`, or a Keras
            preset's `config.json` "config").

    Returns:
        One `Weight` (path, shape, dtype) per weight, in the model's order.

    Example:
    ```python
    import keras_hub
    variables = model_variables(keras_hub.models.GemmaBackbone, config)
    ```
    """
    config = _serialized(config)
    text, plain = _build_key(config)
    if plain and _is_keras_hub_class(backbone_cls):
        # A class of the installed keras-hub is what its name and the
        # versions in the disk key say it is: an earlier process's build
        # stands for this one.
        stored = stored_variables(backbone_cls.__name__, config)
        if stored is not None:
            return stored
    found = _cached_variables(backbone_cls, text, _Frozen(config))
    if plain:  # a config that is not plain JSON is cached in memory only
        store(
            CACHE_KIND,
            _disk_key(backbone_cls.__name__, text),
            [[v.path, list(v.shape), v.dtype] for v in found],
        )
    return found


def _is_keras_hub_class(backbone_cls: type) -> bool:
    """Whether `backbone_cls` is keras-hub's own (not a user's subclass,
    which may share its name)."""
    return getattr(backbone_cls, "__module__", "").startswith("keras_hub.")


def _disk_key(class_name: str, config_text: str) -> str:
    return f"{class_name}|{config_text}"


def _variables_key(class_name: str, config: Mapping) -> str | None:
    """The disk key of `class_name` built from `config`, or `None` when the
    config is not plain JSON (cached in memory only)."""
    text, plain = _build_key(config)
    return _disk_key(class_name, text) if plain else None


def stored_variables(class_name: str, config: Mapping) -> tuple[Weight, ...] | None:
    """The abstract build of `class_name` from `config` kept on disk by an
    earlier process, or `None`. Imports neither Keras nor keras-hub.

    Args:
        class_name: the backbone class name, e.g. `"QwenBackbone"`.
        config: its constructor arguments.
    """
    key = _variables_key(class_name, config)
    rows = read_stored(CACHE_KIND, key) if key is not None else None
    try:
        return tuple(
            Weight(str(p), shape=tuple(int(n) for n in shape), dtype=str(dtype))
            for p, shape, dtype in rows
        )
    except (TypeError, ValueError):
        return None  # absent, or unreadable: build again


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
def _cached_variables(backbone_cls, key, frozen) -> tuple[Weight, ...]:
    del key  # part of the cache key only
    from keras_hub_autodist.compat import deferred_variables

    config = dict(frozen.config)
    try:
        with deferred_variables():
            backbone = backbone_cls.from_config(config)
    except (TypeError, ValueError, KeyError) as error:
        missing = _missing_arguments(backbone_cls, config)
        if missing:
            raise ConfigError(
                f"The preset's config has no `{missing[0]}`, which "
                f"{backbone_cls.__name__} needs (it has no default). Add it to "
                f"the preset's config.json. Received: config keys {sorted(config)}"
            ) from error
        raise ConfigError(
            f"keras-hub could not build {backbone_cls.__name__} from the "
            f"preset's config: {type(error).__name__}: {error}. Fix the "
            "preset's config.json (or the config dict) so that "
            f"`{backbone_cls.__name__}.from_config(config)` works. Received: "
            f"config keys {sorted(config)}"
        ) from error
    # Keras' weights: its non-weight state (the seed generators' RNG
    # state, metric state) is not planned and stays replicated, and is left
    # out here by the class Keras gives it, not by its name.
    weight_ids = {id(weight) for weight in backbone.weights}
    found = tuple(
        Weight(v.path, shape=tuple(int(size) for size in v.shape), dtype=str(v.dtype))
        for v in backbone.variables
        if id(v) in weight_ids
    )
    del backbone
    return found


def _missing_arguments(backbone_cls: type, config: Mapping) -> list[str]:
    """The constructor arguments of `backbone_cls` without a default that
    `config` lacks."""
    try:
        parameters = inspect.signature(backbone_cls.__init__).parameters
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        name
        for name, parameter in list(parameters.items())[1:]
        if parameter.kind in kinds
        and parameter.default is inspect.Parameter.empty
        and name not in config
    ]


def clear_cache() -> None:
    """Forget the cached abstract builds."""
    _cached_variables.cache_clear()
