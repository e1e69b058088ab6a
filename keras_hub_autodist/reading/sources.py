"""The first step of reading a preset: its source, read into a `ConfigSource`.

Every form `plan()` accepts is read here as far as it can be without Keras
or keras-hub (importing them takes seconds):

- a path object: spelled as a folder path, then read as a string;
- a string: a local folder's `config.json` is read (and its problems
  named); a handle or a built-in name is left to keras-hub's loader;
- a config dict: its form (`config_dict_kind`) and how a plan names it;
- a keras-hub backbone or task instance: its class and `get_config()`.

The next step (`configs.py`) turns the `ConfigSource` into a `PresetConfig`.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Mapping

from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.reading.records import CONFIG_DICT
from keras_hub_autodist.reading.records import CONFIG_FILE
from keras_hub_autodist.reading.records import HF_CONFIG_DICT
from keras_hub_autodist.reading.records import ConfigSource
from keras_hub_autodist.reading.records import check_config_object


def read_source(preset) -> ConfigSource:
    """Read any source `plan()` accepts into a `ConfigSource`.

    Args:
        preset: a folder (a string or a path object), an `hf://` or
            `kaggle://` handle, a built-in preset name, a config dict, or a
            keras-hub backbone or task instance.

    Example:
    >>> read_source({"model_type": "llama"}).preset
    '<Hugging Face config dict>'
    """
    if isinstance(preset, os.PathLike):
        preset = _path_string(preset)
    if isinstance(preset, str):
        return _string_source(preset)
    if isinstance(preset, Mapping):
        return dict_source(preset)
    return _instance_source(preset)


def _path_string(path: os.PathLike) -> str:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    # A path object is a folder: spell it as one, never as a preset name.
    if not os.path.isabs(text) and not text.startswith((".", "~")):
        text = os.path.join(os.curdir, text)
    return text


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


def _string_source(preset: str) -> ConfigSource:
    """A preset string: a local folder's `config.json` read here; anything
    else (handles, built-in names, a folder without one) left to keras-hub."""
    if not is_local_folder(preset):
        return ConfigSource(preset, None)
    path = os.path.join(os.path.expanduser(preset), CONFIG_FILE)
    source = ConfigSource(preset, None, folder=preset)
    if not os.path.isfile(path):
        return source
    try:
        with open(path, encoding="utf-8") as file:
            raw = json.load(file)
    except OSError:
        return source  # keras-hub's loader reports it
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
    return ConfigSource(preset, raw, folder=preset)


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


def dict_source(raw: Mapping) -> ConfigSource:
    """A config dict: its form (`config_dict_kind`) and how a plan names it.

    Example:
    >>> dict_source({"class_name": "GemmaBackbone", "config": {}}).preset
    '<config dict>'
    """
    kind = config_dict_kind(raw)
    label = HF_CONFIG_DICT if kind == "transformers" else CONFIG_DICT
    return ConfigSource(label, raw, dict_kind=kind)


def _instance_source(model) -> ConfigSource:
    """A keras-hub backbone or task: its backbone's class and config, as
    the config dict `{"class_name": cls, "config": ...}`."""
    keras_hub = sys.modules.get("keras_hub")
    models = getattr(keras_hub, "models", None)
    if models is None or not isinstance(model, (models.Backbone, models.Task)):
        raise PlanInputError(
            "`plan()` and `get_layout_map()` take a preset (a folder path, "
            "`hf://…`, `kaggle://…` or a preset name), a config dict (a "
            "config.json's contents, or {'class_name': 'GemmaBackbone', "
            "'config': backbone.get_config()}) or a keras-hub backbone or "
            f"task instance. Received: preset={model!r} of type "
            f"{type(model).__name__}"
        )
    label = f"<{type(model).__name__} instance>"
    backbone = model
    if isinstance(model, models.Task):
        backbone = getattr(model, "backbone", None)
        if not isinstance(backbone, models.Backbone):
            raise PlanInputError(
                f"This {type(model).__name__} has no keras-hub backbone to "
                "plan; pass the backbone, a preset or a config dict. "
                f"Received: preset={label}, backbone={backbone!r}"
            )
    config = dict(backbone.get_config())
    # Constructor arguments some get_config() forget (keras-hub 0.32's
    # LlamaBackbone drops `tie_word_embeddings`) are read from the instance.
    for name in inspect.signature(type(backbone).__init__).parameters:
        value = getattr(backbone, name, None)
        if name not in config and isinstance(value, (bool, int, float, str)):
            config[name] = value
    raw = {"class_name": type(backbone), "config": config}
    return ConfigSource(label, raw, dict_kind="class")
