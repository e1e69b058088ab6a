"""Find the architecture handler of a backbone class through entry points.

Handlers are registered in the entry-point group
`keras_hub_autodist.architectures`; the entry-point *name* is a backbone class
name and its *value* the handler object, e.g. in a `pyproject.toml`:

```toml
[project.entry-points."keras_hub_autodist.architectures"]
MyBackbone = "my_package.layouts:MY_HANDLER"
```

Lookup walks the backbone class's MRO, so `Llama3Backbone` uses the handler
registered for `LlamaBackbone`. The built-in handlers are registered the same
way in this package's own `pyproject.toml`.

Planning a local config does not import keras-hub, so it looks handlers up by
class *name* (`handler_by_name`): a registered name, or a keras-hub subclass
listed in `KNOWN_SUBCLASSES` with its registered base.
"""

from __future__ import annotations

import functools
import warnings
from importlib import metadata

from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.errors import UnsupportedArchitectureError

ENTRY_POINT_GROUP = "keras_hub_autodist.architectures"
# keras-hub backbones that subclass a registered one, by name, so that lookup
# by name agrees with lookup by MRO without importing keras-hub. A test checks
# each against keras-hub's classes.
KNOWN_SUBCLASSES = {"Llama3Backbone": "LlamaBackbone"}
DOCS_ADDING_AN_ARCHITECTURE = "docs/architectures.md#adding-an-architecture"


@functools.cache
def _entry_points() -> dict[str, metadata.EntryPoint]:
    found = {}
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, entry_point)
    return found


@functools.cache
def _load(name: str) -> Architecture | None:
    entry_point = _entry_points()[name]
    try:
        handler = entry_point.load()
    except Exception as error:  # a broken plugin must not break the others
        warnings.warn(
            f"keras_hub_autodist: the architecture handler {name!r} "
            f"({entry_point.value}) failed to load and is skipped: "
            f"{type(error).__name__}: {error}",
            stacklevel=3,
        )
        return None
    if isinstance(handler, type):
        handler = handler()
    return handler


def registered_architectures() -> list[str]:
    """Names of the backbone classes that have a handler installed.

    Example:
    >>> "GemmaBackbone" in registered_architectures()
    True
    """
    return sorted(_entry_points())


def clear_cache() -> None:
    """Forget discovered entry points (after installing a plugin)."""
    _entry_points.cache_clear()
    _load.cache_clear()


def handler_for(backbone_cls: type) -> Architecture:
    """Return the handler for `backbone_cls`, following its MRO.

    Args:
        backbone_cls: a keras-hub `Backbone` subclass.

    Example:
    >>> import keras_hub
    >>> handler_for(keras_hub.models.Llama3Backbone).name
    'llama'
    """
    available = _entry_points()
    for klass in backbone_cls.__mro__:
        if klass.__name__ in available:
            handler = _load(klass.__name__)
            if handler is not None:
                return handler
    raise UnsupportedArchitectureError(
        f"keras_hub_autodist has no layout for {backbone_cls.__name__}. "
        f"Supported backbones: {', '.join(registered_architectures())}. "
        "To add one, register a handler in the entry-point group "
        f"'{ENTRY_POINT_GROUP}' (see {DOCS_ADDING_AN_ARCHITECTURE}). "
        f"Received: backbone class {backbone_cls.__module__}."
        f"{backbone_cls.__qualname__}"
    )


def handler_by_name(class_name: str) -> Architecture | None:
    """The handler for a backbone class given by name, or `None`.

    Finds handlers registered under `class_name` or, for the keras-hub
    subclasses in `KNOWN_SUBCLASSES`, under their base class. `None` means
    "ask `handler_for` with the class itself" (its MRO may still find one).

    Args:
        class_name: a backbone class name such as `"Llama3Backbone"`.

    Example:
    >>> handler_by_name("Llama3Backbone").name
    'llama'
    """
    available = _entry_points()
    name = class_name
    while name is not None:
        if name in available:
            handler = _load(name)
            if handler is not None:
                return handler
        name = KNOWN_SUBCLASSES.get(name)
    return None
