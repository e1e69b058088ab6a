"""Small JSON entries kept on disk for later processes, under
`~/.cache/keras_hub_autodist/abstract` (or `$XDG_CACHE_HOME`, or
`$KERAS_HUB_AUTODIST_CACHE`; `off` turns the disk cache off).

The abstract builds of backbones (`abstract.py`) and keras-hub's conversions
of Hugging Face configs (`configs.py`) are kept here, so that a later
process, the CLI's included, plans the same preset without importing
keras-hub. Each file is an entry that records what it answers: its format,
kind, key, the keras and keras-hub versions, and a digest of its value. An
entry is served only when all of them match the request, so a file of an
older format, copied from another key, or edited by hand is computed again,
and `store` rewrites it. Entries are created with the permissions the umask
allows, so a cache folder shared by several users serves them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import secrets
from importlib import metadata

from keras_hub_autodist.environment import read_folder_switch

CACHE_ENV = "KERAS_HUB_AUTODIST_CACHE"


def cache_folder() -> pathlib.Path | None:
    """Where entries are kept on disk, or `None` when turned off.

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
    setting, named = read_folder_switch(CACHE_ENV)
    if setting is False:
        return None
    if named:
        return pathlib.Path(named).expanduser()
    return package_cache_root() / "abstract"


def package_cache_root() -> pathlib.Path:
    """The package's default cache folder: `keras_hub_autodist` under
    `$XDG_CACHE_HOME` when it is an absolute path, else under `~/.cache`.

    Example:
    >>> package_cache_root().name
    'keras_hub_autodist'
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "keras_hub_autodist"


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
