"""What a preset's config says, read without Keras or keras-hub.

A `PresetConfig` is the first value of the data path: the backbone class (or
its name) and the constructor arguments `from_preset` will build from. This
module reads the forms that need neither Keras nor keras-hub (importing them
takes seconds):

- a local folder's `config.json`: a Keras preset's as is, a Hugging Face
  one as keras-hub's converter converted it in an earlier process (kept on
  disk by `store_conversion`, `disk_cache.py`);
- a config dict (the contents of a `config.json`, or a backbone's
  `get_config()` with its class).

Anything else (handles, built-in names, Hugging Face configs not converted
yet) is read through keras-hub's own loaders and converters in
`presets.py`, so there is one conversion of each config: keras-hub's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from keras_hub_autodist.compat.tied_embeddings import local_weights_file
from keras_hub_autodist.compat.tied_embeddings import with_tying
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.reading import disk_cache

CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class PresetConfig:
    """What planning needs to know about a preset.

    Args:
        preset: the preset as given (path or handle).
        backbone_cls: the keras-hub backbone class `from_preset` will build,
            or `None` when the config was read without keras-hub.
        config: the backbone's constructor arguments.
        format: `"keras"` or `"transformers"`.
        backbone_class: the name of the backbone class; defaults to
            `backbone_cls.__name__`.

    Example:
    >>> info = PresetConfig("./p", None, {"num_layers": 2}, "keras", "GemmaBackbone")
    >>> info.backbone_class
    'GemmaBackbone'
    """

    preset: str
    backbone_cls: type | None
    config: Mapping
    format: str
    backbone_class: str = ""

    def __post_init__(self):
        if not self.backbone_class and self.backbone_cls is not None:
            object.__setattr__(self, "backbone_class", self.backbone_cls.__name__)


# Hugging Face model types whose vision tower is planned (keras-hub
# converts it); other checkpoints with a `vision_config` are refused.
VISION_TOWER_MODEL_TYPES = ("gemma3",)


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
    # A local folder's weights say whether a config that leaves out tying
    # is tied (`tied_embeddings`); keras-hub's load reads it the same way.
    weights = local_weights_file(preset) if is_local_folder(preset) else None
    return with_tying(raw, config, weights)


def missing_hf_field(field, raw: Mapping, preset) -> ConfigError:
    return ConfigError(
        f"The Hugging Face `{CONFIG_FILE}` (model_type="
        f"{raw.get('model_type')!r}) has no `{field}`, which the conversion "
        "to a keras-hub config needs. Add the field (see the model's "
        f"original config). Received: preset={preset!r}"
    )


# --- Local folders, read without Keras or keras-hub. ------------------------


def is_local_folder(preset) -> bool:
    """True for a string that keras-hub reads as a local folder.

    Built-in preset names win over folders in keras-hub, so a bare name
    without a path separator (`"gemma_2b_en"`) is never taken for a folder
    here; write `./gemma_2b_en` for a folder of that name.

    Example:
    >>> is_local_folder("gemma_2b_en"), is_local_folder("hf://google/gemma")
    (False, False)
    """
    if not isinstance(preset, str) or "://" in preset:
        return False
    spelled_as_path = (
        os.sep in preset
        or (os.altsep is not None and os.altsep in preset)
        or preset.startswith(".")
        or preset.startswith("~")
    )
    return spelled_as_path and os.path.isdir(os.path.expanduser(preset))


def read_local_config(preset: str) -> PresetConfig | None:
    """Read a local preset folder's config without Keras or keras-hub.

    Covers Keras presets of `keras_hub>` backbones and Hugging Face
    checkpoints whose config keras-hub converted in an earlier process.
    Returns `None` for anything else (handles, built-in names, configs not
    converted yet), which `read_preset_config` reads through keras-hub. The result has
    `backbone_cls=None` and the class name in `backbone_class`.

    Args:
        preset: a local folder.

    Example:
    ```python
    info = read_local_config("./gemma_2b")
    info.backbone_class, info.config["num_key_value_heads"]
    ```
    """
    if not is_local_folder(preset):
        return None
    path = os.path.join(os.path.expanduser(preset), CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            raw = json.load(file)
    except OSError:
        return None  # keras-hub's loader reports it
    except UnicodeDecodeError as error:
        raise PresetError(
            f"The preset's `{CONFIG_FILE}` at {path} is not UTF-8 text "
            f"({error}). Save it again as UTF-8 JSON. Received: preset={preset!r}"
        ) from error
    except json.JSONDecodeError as error:
        raise PresetError(
            f"The preset's `{CONFIG_FILE}` at {path} is not valid JSON "
            f"({error}). Fix or replace the file. Received: preset={preset!r}"
        ) from error
    check_config_object(raw, path, preset)
    if "registered_name" in raw:
        package, _, name = str(raw["registered_name"]).partition(">")
        if package != "keras_hub" or not name:
            return None
        return PresetConfig(preset, None, keras_config(raw, preset), "keras", name)
    if "model_type" in raw:
        reject_vision_towers(raw, preset)
        # keras-hub's converter reads it, unless an earlier process did.
        return _stored_conversion(raw, preset)
    return None


def check_config_object(raw, where: str, preset) -> None:
    """Raise `ConfigError` unless a `config.json`'s contents are a JSON object.

    Example:
    >>> check_config_object(None, "./p/config.json", "./p")
    Traceback (most recent call last):
    ...
    keras_hub_autodist.errors.ConfigError: The preset's `config.json` at ./p/config.json holds null, not a JSON object of the backbone's configuration. Save the model again with `save_to_preset`, or restore the file. Received: preset='./p'
    """  # noqa: E501
    if not isinstance(raw, Mapping):
        text = (
            json.dumps(raw)
            if raw is None or isinstance(raw, (int, float))
            else (f"a JSON {type(raw).__name__}")
        )
        raise ConfigError(
            f"The preset's `{CONFIG_FILE}` at {where} holds {text}, not a JSON "
            "object of the backbone's configuration. Save the model again "
            "with `save_to_preset`, or restore the file. Received: "
            f"preset={preset!r}"
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


# --- Config dicts: the contents of a config.json, or get_config() + class. --

CONFIG_DICT = "<config dict>"
HF_CONFIG_DICT = "<Hugging Face config dict>"


def config_dict_kind(raw: Mapping) -> str:
    """Which form of config dict `raw` is: `"keras"` (a Keras preset's
    `config.json`, with `registered_name`), `"class"` (`class_name` and
    `config`, e.g. a backbone's `get_config()` with its class) or
    `"transformers"` (a Hugging Face `config.json`, with `model_type`).

    Raises:
        PlanInputError: for a mapping of none of these forms.

    Example:
    >>> config_dict_kind({"model_type": "llama"})
    'transformers'
    """
    if "registered_name" in raw:
        return "keras"
    if "class_name" in raw:
        return "class"
    if "model_type" in raw:
        return "transformers"
    raise PlanInputError(
        "A config dict must say which backbone it configures. Pass a Keras "
        "preset's config.json as a dict (with `registered_name`, e.g. "
        "'keras_hub>GemmaBackbone'), a Hugging Face config.json as a dict "
        "(with `model_type`), or a backbone's config with its class: "
        "{'class_name': 'GemmaBackbone', 'config': backbone.get_config()}; "
        "or pass the backbone itself. Received: a dict with keys "
        f"{sorted(map(str, raw))[:12]}"
    )


def config_dict_label(raw: Mapping) -> str:
    """How a plan made from the config dict `raw` names its source.

    Example:
    >>> config_dict_label({"model_type": "llama"})
    '<Hugging Face config dict>'
    """
    return HF_CONFIG_DICT if config_dict_kind(raw) == "transformers" else CONFIG_DICT


def _class_config(raw: Mapping, label: str) -> dict:
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError(
            "With `class_name`, a config dict holds the backbone's arguments "
            "under `config`: {'class_name': 'GemmaBackbone', 'config': "
            "backbone.get_config()}. Received: "
            f"config={config!r} in preset={label!r}"
        )
    return dict(config)


def read_local_config_dict(raw: Mapping) -> PresetConfig | None:
    """Read a config dict without Keras or keras-hub, when possible.

    The dict forms are those of `config_dict_kind`. Returns `None` when
    keras-hub is needed (a registered name outside keras-hub, a Hugging Face
    config keras-hub has not converted before); `read_config_dict` reads
    those.

    Args:
        raw: the config dict; it is not modified.

    Example:
    >>> read_local_config_dict({"class_name": "GemmaBackbone",
    ...     "config": {"num_layers": 2}}).backbone_class
    'GemmaBackbone'
    """
    kind = config_dict_kind(raw)
    label = config_dict_label(raw)
    if kind == "keras":
        package, _, name = str(raw["registered_name"]).partition(">")
        if package != "keras_hub" or not name:
            return None
        return PresetConfig(label, None, keras_config(raw, label), "keras", name)
    if kind == "class":
        class_name = raw["class_name"]
        config = _class_config(raw, label)
        if isinstance(class_name, type):
            return PresetConfig(label, class_name, config, "keras")
        if not isinstance(class_name, str) or not class_name:
            raise PlanInputError(
                "`class_name` names the backbone class, e.g. 'GemmaBackbone', "
                "or is the class itself. Received: "
                f"class_name={class_name!r} in preset={label!r}"
            )
        return PresetConfig(label, None, config, "keras", class_name)
    reject_vision_towers(raw, label)
    return _stored_conversion(raw, label)
