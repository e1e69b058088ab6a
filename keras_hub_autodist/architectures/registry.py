"""Find the architecture (the rule table) of a backbone class.

Architectures come from two places, looked up the same way:

- the built-in families, registered in code in `BUILTIN_ARCHITECTURES`
  (so a source checkout plans without being installed);
- other packages, through the entry-point group
  `keras_hub_autodist.architectures`. The entry-point *name* is a backbone
  class name and its *value* the architecture object, e.g. in a `pyproject.toml`:

```toml
[project.entry-points."keras_hub_autodist.architectures"]
MyBackbone = "my_package.layouts:MY_ARCHITECTURE"
```

Discovery is cached (`clear_cache()` forgets it after installing a plugin)
and architectures are imported on first use. A plugin that fails to import is
skipped with a warning. When two registrations share a name, a warning says
which one is used: a built-in always wins over a plugin, and among plugins
the first one found on `sys.path` wins. An entry point naming exactly the
built-in architecture (e.g. the metadata of an older install of this package) is
not a conflict and is ignored silently.

Lookup walks the backbone class's MRO, so `Llama3Backbone` uses the architecture
registered for `LlamaBackbone`.

Planning a local config does not import keras-hub, so it looks architectures up by
class *name* (`architecture_by_name`): a registered name, or a keras-hub subclass
listed in `KNOWN_SUBCLASSES` with its registered base.
"""

from __future__ import annotations

import functools
from importlib import metadata

from keras_hub_autodist.architectures.base import DOCS_ADDING_AN_ARCHITECTURE
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.errors import warn

ENTRY_POINT_GROUP = "keras_hub_autodist.architectures"
# The built-in families: backbone class name -> "module:object" of the
# architecture, loaded exactly like an entry point's value.
BUILTIN_ARCHITECTURES = {
    "Gemma3Backbone": "keras_hub_autodist.architectures.gemma3:GEMMA3",
    "Gemma4Backbone": "keras_hub_autodist.architectures.gemma4:GEMMA4",
    "GemmaBackbone": "keras_hub_autodist.architectures.gemma:GEMMA",
    "LlamaBackbone": "keras_hub_autodist.architectures.llama:LLAMA",
    "MistralBackbone": "keras_hub_autodist.architectures.llama:MISTRAL",
    "MixtralBackbone": "keras_hub_autodist.architectures.mixtral:MIXTRAL",
    "Phi3Backbone": "keras_hub_autodist.architectures.phi3:PHI3",
    "Qwen3Backbone": "keras_hub_autodist.architectures.qwen:QWEN3",
    "Qwen3MoeBackbone": "keras_hub_autodist.architectures.qwen_moe:QWEN3_MOE",
    "QwenBackbone": "keras_hub_autodist.architectures.qwen:QWEN",
    "QwenMoeBackbone": "keras_hub_autodist.architectures.qwen_moe:QWEN_MOE",
    "SmolLM3Backbone": "keras_hub_autodist.architectures.smollm3:SMOLLM3",
}
BUILTIN_SOURCE = "built-in"
# keras-hub backbones that subclass a registered one, by name, so that lookup
# by name agrees with lookup by MRO without importing keras-hub. A test checks
# each against keras-hub's classes.
KNOWN_SUBCLASSES = {"Llama3Backbone": "LlamaBackbone"}

# Registrations that failed to load: name -> "value (ErrorType: message)".
_failed: dict[str, str] = {}


def _source_of(entry_point: metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return f"plugin {name}" if name else "plugin"


@functools.cache
def _registrations() -> dict[str, tuple[metadata.EntryPoint, str]]:
    """Name -> (entry point, source) of every architecture, built-ins first."""
    found = {
        name: (metadata.EntryPoint(name, value, ENTRY_POINT_GROUP), BUILTIN_SOURCE)
        for name, value in BUILTIN_ARCHITECTURES.items()
    }
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        previous = found.get(entry_point.name)
        if previous is None:
            found[entry_point.name] = (entry_point, _source_of(entry_point))
            continue
        kept, kept_source = previous
        if kept.value == entry_point.value:
            continue  # the same architecture registered twice: no conflict
        warn(
            f"keras_hub_autodist: two architectures are registered "
            f"for {entry_point.name!r}: {kept.value} ({kept_source}) and "
            f"{entry_point.value} ({_source_of(entry_point)}). Using "
            f"{kept.value} ({kept_source}): built-in architectures win over "
            "plugins, and the first plugin found on sys.path wins over later "
            "ones. To lay out a built-in family differently, register your "
            "architecture for a subclass of its backbone. Received: entry point "
            f"{entry_point.name} = {entry_point.value}",
        )
    return found


@functools.cache
def _load(name: str) -> Architecture | None:
    entry_point, source = _registrations()[name]
    try:
        architecture = entry_point.load()
    except Exception as error:  # a broken plugin must not break the others
        _failed[name] = f"{entry_point.value} ({type(error).__name__}: {error})"
        warn(
            f"keras_hub_autodist: the architecture {name!r} "
            f"({entry_point.value}, {source}) failed to load and is skipped: "
            f"{type(error).__name__}: {error}",
        )
        return None
    if isinstance(architecture, type):
        architecture = architecture()
    return architecture


def registered_architectures() -> list[str]:
    """Names of the backbone classes that have an architecture (built-in or plugin).

    Example:
    >>> "GemmaBackbone" in registered_architectures()
    True
    """
    return sorted(_registrations())


def architecture_sources() -> dict[str, str]:
    """Where each registered architecture comes from: `"built-in"` or
    `"plugin <distribution>"`.

    Example:
    >>> architecture_sources()["GemmaBackbone"]
    'built-in'
    """
    return {name: source for name, (_, source) in sorted(_registrations().items())}


def clear_cache() -> None:
    """Forget discovered entry points (after installing a plugin)."""
    _registrations.cache_clear()
    _load.cache_clear()
    _failed.clear()


def unsupported_error(class_name: str, received: str) -> UnsupportedArchitectureError:
    """The error for a backbone class without an architecture, listing the
    registered ones (and any plugin that failed to load).

    Args:
        class_name: the backbone class name.
        received: what the caller passed, for the `Received:` part.
    """
    supported = [name for name in registered_architectures() if name not in _failed]
    broken = "".join(
        f" Failed to load (see the warnings): {name} = {why}."
        for name, why in sorted(_failed.items())
    )
    return UnsupportedArchitectureError(
        f"keras_hub_autodist has no layout for {class_name}. "
        f"Supported backbones: {', '.join(supported)}.{broken} "
        "To add one, register an architecture in the entry-point group "
        f"'{ENTRY_POINT_GROUP}' (see {DOCS_ADDING_AN_ARCHITECTURE}). "
        f"Received: {received}"
    )


def architecture_for(backbone_cls: type) -> Architecture:
    """Return the architecture for `backbone_cls`, following its MRO.

    Args:
        backbone_cls: a keras-hub `Backbone` subclass.

    Example:
    >>> import keras_hub
    >>> architecture_for(keras_hub.models.Llama3Backbone).name
    'llama'
    """
    available = _registrations()
    for klass in backbone_cls.__mro__:
        if klass.__name__ in available:
            architecture = _load(klass.__name__)
            if architecture is not None:
                return architecture
    raise unsupported_error(
        backbone_cls.__name__,
        f"backbone class {backbone_cls.__module__}.{backbone_cls.__qualname__}",
    )


def architecture_by_name(class_name: str) -> Architecture | None:
    """The architecture for a backbone class given by name, or `None`.

    Finds architectures registered under `class_name` or, for the keras-hub
    subclasses in `KNOWN_SUBCLASSES`, under their base class. `None` means
    "ask `architecture_for` with the class itself" (its MRO may still find one).

    Args:
        class_name: a backbone class name such as `"Llama3Backbone"`.

    Example:
    >>> architecture_by_name("Llama3Backbone").name
    'llama'
    """
    available = _registrations()
    name = class_name
    while name is not None:
        if name in available:
            architecture = _load(name)
            if architecture is not None:
                return architecture
        name = KNOWN_SUBCLASSES.get(name)
    return None
