"""The second step of reading a preset: its `ConfigSource` as a `PresetConfig`.

A `PresetConfig` is the first value of the data path: the backbone class (or
its name) and the constructor arguments `from_preset` will build from. The
raw config a source holds is read without Keras or keras-hub whenever it
can be (importing them takes seconds):

- a Keras preset's config of a `keras_hub>` backbone, as is;
- a Hugging Face config, as keras-hub's converter converted it in an
  earlier process (kept on disk by `store_conversion`, `disk_cache.py`);
- a backbone's config with its class (a config dict, or a model instance).

Anything else (handles, built-in names, other registered classes, Hugging
Face configs not converted yet) is read through keras-hub's own loader
(`loaders.py`) and converters, so there is one conversion of each config:
keras-hub's. A local Keras preset's weights say whether a config that
leaves out tying is tied (`compat.tied_embeddings`), last.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping

from keras_hub_autodist import compat
from keras_hub_autodist.compat.tied_embeddings import local_weights_file
from keras_hub_autodist.compat.tied_embeddings import with_tying
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.reading import disk_cache
from keras_hub_autodist.reading.loaders import open_loader
from keras_hub_autodist.reading.records import CONFIG_FILE
from keras_hub_autodist.reading.records import ConfigSource
from keras_hub_autodist.reading.records import PresetConfig
from keras_hub_autodist.reading.records import check_config_object
from keras_hub_autodist.reading.records import neither_format_error

# Hugging Face model types whose vision tower is planned (keras-hub
# converts it); other checkpoints with a `vision_config` are refused.
VISION_TOWER_MODEL_TYPES = ("gemma3",)


# How `preset_config` may use keras-hub.
IF_NEEDED = "if needed"
ALWAYS = "always"
NEVER = "never"


def preset_config(
    source: ConfigSource, *, keras_hub: str = IF_NEEDED
) -> PresetConfig | None:
    """The `PresetConfig` of a source, read without keras-hub when it can be.

    The raw config is always checked without keras-hub first, so that its
    own problems are named before keras-hub's.

    Args:
        source: a `ConfigSource` (`sources.read_source`).
        keras_hub: `IF_NEEDED`; `ALWAYS` to resolve the backbone class with
            keras-hub even when the config reads without it; `NEVER` to
            return `None` where keras-hub would be needed.

    Example:
    ```python
    preset_config(read_source("./gemma_2b")).backbone_class
    ```
    """
    info = without_keras_hub(source)
    if keras_hub == NEVER and info is None:
        return None
    if info is None or (keras_hub == ALWAYS and info.backbone_cls is None):
        info = _through_keras_hub(source)
    if source.folder is None or source.raw is None or info.format != "keras":
        return info
    weights = local_weights_file(source.folder)
    return dataclasses.replace(
        info, config=with_tying(source.raw, info.config, weights)
    )


def without_keras_hub(source: ConfigSource) -> PresetConfig | None:
    """The `PresetConfig` of a source read without Keras or keras-hub, with
    `backbone_cls=None` and the class name in `backbone_class` (unless a
    class was given); `None` when keras-hub must read it.

    Example:
    >>> raw = {"class_name": "GemmaBackbone", "config": {"num_layers": 2}}
    >>> source = ConfigSource("<config dict>", raw, "class")
    >>> without_keras_hub(source).backbone_class
    'GemmaBackbone'
    """
    raw, preset = source.raw, source.preset
    if raw is None:
        return None
    if "registered_name" in raw:
        package, _, name = str(raw["registered_name"]).partition(">")
        if package != "keras_hub" or not name:
            return None
        return PresetConfig(preset, None, keras_config(raw, preset), "keras", name)
    if source.dict_kind == "class":
        return _class_config(raw, preset)
    if "model_type" in raw:
        reject_vision_towers(raw, preset)
        # keras-hub's converter reads it, unless an earlier process did.
        return _stored_conversion(raw, preset)
    return None


def _class_config(raw: Mapping, label: str) -> PresetConfig:
    class_name = raw["class_name"]
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError(
            "With `class_name`, a config dict holds the backbone's arguments "
            "under `config`: {'class_name': 'GemmaBackbone', 'config': "
            "backbone.get_config()}. Received: "
            f"config={config!r} in preset={label!r}"
        )
    if isinstance(class_name, type):
        return PresetConfig(label, class_name, dict(config), "keras")
    if not isinstance(class_name, str) or not class_name:
        raise PlanInputError(
            "`class_name` names the backbone class, e.g. 'GemmaBackbone', "
            "or is the class itself. Received: "
            f"class_name={class_name!r} in preset={label!r}"
        )
    return PresetConfig(label, None, dict(config), "keras", class_name)


def _through_keras_hub(source: ConfigSource) -> PresetConfig:
    """The backbone class resolved by keras-hub: a class name among its
    registered backbones, else through its loader, whose Hugging Face
    converter converts the config."""
    if source.dict_kind == "class":
        return _registered_class(source)
    loader = open_loader(source)
    raw, preset = loader.config, source.preset
    check_config_object(raw, CONFIG_FILE, preset)
    if "registered_name" not in raw and "model_type" not in raw:
        raise neither_format_error(preset)
    if "registered_name" in raw:
        backbone_cls = _backbone_class(loader, raw, source)
        return PresetConfig(preset, backbone_cls, keras_config(raw, preset), "keras")
    reject_vision_towers(raw, preset)
    return _converted(loader, raw, preset)


def _registered_class(source: ConfigSource) -> PresetConfig:
    import keras
    import keras_hub  # noqa: F401  (registers keras-hub's classes)

    info = _class_config(source.raw, source.preset)
    name = info.backbone_class
    cls = keras.saving.get_registered_object(f"keras_hub>{name}")
    if cls is None:
        raise PlanInputError(
            f"keras-hub has no backbone class named {name!r}. Give the "
            "class itself, {'class_name': MyBackbone, 'config': ...}, or "
            "pass the backbone instance. Received: "
            f"class_name={name!r} in preset={source.preset!r}"
        )
    return PresetConfig(source.preset, cls, info.config, "keras")


def _backbone_class(loader, raw: Mapping, source: ConfigSource) -> type:
    """The class a Keras preset's `registered_name` names, registered with
    Keras (by importing its package)."""
    try:
        return loader.check_backbone_class()
    except ValueError as error:
        name = raw["registered_name"]
        if source.dict_kind:
            raise PlanInputError(
                f"No class is registered with Keras as {name!r}: import the "
                "package that defines it first, or pass the backbone "
                f"instance. Received: registered_name={name!r} in "
                f"preset={source.preset!r}"
            ) from error
        raise UnsupportedArchitectureError(
            f"No class is registered with Keras as {name!r}, the class the "
            f"preset's `{CONFIG_FILE}` names: import the package that "
            "defines it first, or fix `registered_name`. Received: "
            f"registered_name={name!r} in preset={source.preset!r}"
        ) from error


def _converted(loader, raw: Mapping, preset) -> PresetConfig:
    """A Hugging Face config converted by keras-hub's converter, and kept
    on disk for later processes."""
    backbone_cls = loader.check_backbone_class()
    convert = loader.converter.convert_backbone_config
    try:
        # Converters may build sub-models (Gemma 3's vision encoder):
        # their variables get shapes, never values.
        with compat.deferred_variables():
            if len(inspect.signature(convert).parameters) != 1:
                config = convert(raw, backbone_cls)
            else:
                config = convert(raw)
    except KeyError as error:
        raise missing_hf_field(error.args[0], raw, preset) from error
    store_conversion(raw, backbone_cls.__name__, config)
    return PresetConfig(preset, backbone_cls, dict(config), "transformers")


def keras_config(raw: Mapping, preset) -> dict:
    """The backbone's arguments of a Keras preset's `config.json` `raw`."""
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"The `config` entry of the preset's `{CONFIG_FILE}` must be a "
            "mapping of the backbone's arguments. Save the model again with "
            f"`save_to_preset`. Received: config={config!r} in "
            f"preset={preset!r}"
        )
    return dict(config)


def reject_vision_towers(raw: Mapping, preset) -> None:
    if (
        raw.get("vision_config") is not None
        and raw.get("model_type") not in VISION_TOWER_MODEL_TYPES
    ):
        raise UnsupportedArchitectureError(
            "keras_hub_autodist plans the vision towers of "
            f"{', '.join(VISION_TOWER_MODEL_TYPES)} only; this Hugging Face "
            f"checkpoint (model_type={raw['model_type']!r}) has a vision "
            "tower. Use its text-only variant or your own layout map. "
            f"Received: preset={preset!r}"
        )


def missing_hf_field(field, raw: Mapping, preset) -> ConfigError:
    return ConfigError(
        f"The Hugging Face `{CONFIG_FILE}` (model_type="
        f"{raw.get('model_type')!r}) has no `{field}`, which the conversion "
        "to a keras-hub config needs. Add the field (see the model's "
        f"original config). Received: preset={preset!r}"
    )


def _conversion_key(raw: Mapping) -> str | None:
    try:
        return json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError):
        return None


def store_conversion(raw: Mapping, class_name: str, config: Mapping) -> None:
    """Keep keras-hub's conversion of a Hugging Face config on disk (when it
    is plain JSON), so later processes read it without keras-hub."""
    key = _conversion_key(raw)
    if key is not None:
        disk_cache.store("conversion", key, {"class": class_name, "config": config})


def _stored_conversion(raw: Mapping, preset) -> PresetConfig | None:
    key = _conversion_key(raw)
    stored = disk_cache.read_stored("conversion", key) if key is not None else None
    if not isinstance(stored, Mapping) or not isinstance(stored.get("config"), dict):
        return None
    return PresetConfig(
        preset, None, stored["config"], "transformers", str(stored.get("class"))
    )
