"""The abstract build: a backbone's variables (paths, shapes, dtypes) from its
config, without allocating any of them.

The backbone class itself is built from the config inside
`keras.StatelessScope(initialize_variables=False)`: Keras then defers every
variable's initializer, so no array exists. The variables' paths and shapes
are read, and the model is dropped.

Results are cached per backbone class and config: in memory, so re-planning
the same preset on another mesh is immediate, and on disk (a small JSON file
per config under `~/.cache/keras_hub_autodist/abstract`, keyed by the
keras and keras-hub versions), so a later process, the CLI's included, plans
the same config without importing keras-hub. keras-hub's conversions of
Hugging Face configs that have no keras-free conversion here (Mixtral, Qwen,
...) are kept the same way (`store`/`read_stored`). `$KERAS_HUB_AUTODIST_CACHE`
names another folder, or `off` turns the disk cache off.

Each file on disk is an entry that records what it answers: its format, kind,
key (the backbone class and config, or the Hugging Face config converted),
the keras and keras-hub versions, and a digest of its value. An entry is
served only when all of them match the request, so a file of an older format,
copied from another config, or edited by hand is built again, and the build
rewrites it. Entries are created with the permissions the umask allows, so a
cache folder shared by several users serves them all.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import secrets
from collections.abc import Mapping
from importlib import metadata

from keras_hub_autodist.environment import is_off
from keras_hub_autodist.environment import is_on
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.weight import Weight


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
    """Every variable of `backbone_cls.from_config(config)`, built abstractly.

    Args:
        backbone_cls: a keras-hub `Backbone` subclass.
        config: its constructor arguments (`get_config()`, or a Keras
            preset's `config.json` "config").

    Returns:
        One `Weight` (path, shape, dtype) per variable, in the model's order.

    Example:
    ```python
    import keras_hub
    variables = model_variables(keras_hub.models.GemmaBackbone, config)
    ```
    """
    config = _serialized(config)
    text, plain = _config_key(config)
    found = _cached_variables(backbone_cls, text, _Frozen(config))
    if plain:  # a config that is not plain JSON is cached in memory only
        store(
            "variables",
            _disk_key(backbone_cls.__name__, text),
            [[v.path, list(v.shape), v.dtype] for v in found],
        )
    return found


CACHE_ENV = "KERAS_HUB_AUTODIST_CACHE"


def cache_folder() -> pathlib.Path | None:
    """Where abstract builds are kept on disk, or `None` when turned off.

    `$KERAS_HUB_AUTODIST_CACHE` holds an off value of the package's switches
    (`0`, `off`, `no`, `none`..., `environment.OFF_VALUES`): no disk cache;
    an on value (`1`, `on`...) or nothing: the default folder; anything else
    names the folder. The default folder is under `$XDG_CACHE_HOME` when it
    is an absolute path (the XDG spec says to ignore a relative one), else
    under `~/.cache`.

    Example:
    >>> import os
    >>> os.environ[CACHE_ENV] = "off"
    >>> cache_folder() is None
    True
    >>> del os.environ[CACHE_ENV]
    """
    value = os.environ.get(CACHE_ENV, "").strip()
    if is_off(value):
        return None
    if value and not is_on(value):
        return pathlib.Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "keras_hub_autodist" / "abstract"


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "?"


def _disk_file(kind: str, text: str) -> pathlib.Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    key = f"{_version('keras')}|{_version('keras-hub')}|{kind}|{text}"
    return folder / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()}.json"


def _disk_key(class_name: str, config_text: str) -> str:
    return f"{class_name}|{config_text}"


def _variables_key(class_name: str, config: Mapping) -> str | None:
    """The disk key of `class_name` built from `config`, or `None` when the
    config is not plain JSON (cached in memory only)."""
    text, plain = _config_key(config)
    return _disk_key(class_name, text) if plain else None


# The layout of an entry; an entry of another format is built again.
ENTRY_FORMAT = 2


def _entry(kind: str, text: str, value) -> dict:
    """The entry that keeps `value` under `(kind, text)`."""
    return {
        "format": ENTRY_FORMAT,
        "kind": kind,
        "key": text,
        "versions": {name: _version(name) for name in ("keras", "keras-hub")},
        "digest": _digest(value),
        "value": value,
    }


def _digest(value) -> str:
    """A fingerprint of a JSON value, to tell an entry edited after writing."""
    text = json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _entry_text(kind: str, text: str, value) -> str:
    return json.dumps(_entry(kind, text, value), sort_keys=True)


def _served_value(entry, kind: str, text: str):
    """The value of `entry` if it answers `(kind, text)`, else `None`."""
    if not isinstance(entry, dict) or "value" not in entry:
        return None  # an older format, or not an entry at all
    expected = _entry(kind, text, entry["value"])
    recorded = {name: entry.get(name) for name in expected}
    return entry["value"] if recorded == expected else None


def read_stored(kind: str, text: str):
    """The JSON value stored under `(kind, text)` by an earlier process, or
    `None`. Imports neither Keras nor keras-hub.

    An entry that does not record this kind, key and the installed keras and
    keras-hub versions, or whose value does not match its digest, is not
    served: the caller builds the value again and `store` rewrites it.

    Example:
    >>> store("conversion", '{"model_type": "x"}', {"class": "XBackbone"})
    >>> read_stored("conversion", '{"model_type": "x"}')
    {'class': 'XBackbone'}
    >>> read_stored("conversion", '{"model_type": "y"}') is None
    True
    """
    path = _disk_file(kind, text)
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent, or unreadable: computed again
    return _served_value(entry, kind, text)


def store(kind: str, text: str, value) -> None:
    """Keep the JSON `value` under `(kind, text)` for later processes.

    The entry is replaced atomically, unless the file already holds exactly
    this entry; a corrupt, stale or foreign file is so healed by the next
    build. The file gets the permissions the umask allows (`0o644` under the
    common `0o022`). Silently skipped when the cache folder is not writable.

    Example:
    >>> store("conversion", '{"model_type": "x"}', {"class": "XBackbone"})
    """
    path = _disk_file(kind, text)
    if path is None:
        return
    try:
        payload = _entry_text(kind, text, value)
    except (TypeError, ValueError):
        return  # not plain JSON: memory serves this process
    try:
        if path.read_text(encoding="utf-8") == payload:
            return
    except (OSError, ValueError):
        pass  # absent or unreadable: written below
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, payload)
    except OSError:
        pass  # a read-only home: memory serves this process


def _write_atomically(path: pathlib.Path, payload: str) -> None:
    """Write `payload` to a fresh file beside `path`, then move it over `path`.

    The fresh file is created with mode `0o666`, which the operating system
    narrows by the umask, as it does for any file a program creates.
    """
    partial = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(payload)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def stored_variables(class_name: str, config: Mapping) -> tuple[Weight, ...] | None:
    """The abstract build of `class_name` from `config` kept on disk by an
    earlier process, or `None`. Imports neither Keras nor keras-hub.

    Args:
        class_name: the backbone class name, e.g. `"QwenBackbone"`.
        config: its constructor arguments.
    """
    key = _variables_key(class_name, config)
    rows = read_stored("variables", key) if key is not None else None
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
        raise ConfigError(
            f"keras-hub could not build {backbone_cls.__name__} from the "
            f"preset's config: {type(error).__name__}: {error}. Fix the "
            "preset's config.json (or the config dict) so that "
            f"`{backbone_cls.__name__}.from_config(config)` works. Received: "
            f"config keys {sorted(config)}"
        ) from error
    found = tuple(
        Weight(v.path, shape=tuple(int(size) for size in v.shape), dtype=str(v.dtype))
        for v in backbone.variables
    )
    del backbone
    return found


def clear_cache() -> None:
    """Forget the cached abstract builds."""
    _cached_variables.cache_clear()
