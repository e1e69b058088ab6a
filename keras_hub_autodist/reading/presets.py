"""Read a preset's backbone class and config with keras-hub's own loaders.

Local folders and config dicts of the known families are read without
keras-hub (`configs.py`); everything else goes through keras-hub's preset
loaders (`hf://`, `kaggle://`, built-in names, other model types, reached
through `compat`) and its Hugging Face → Keras config converters, so that
planning sees exactly the config `from_preset` will build from. Only
`config.json` is read. `read_config` is the entry of the data path: it takes
anything `plan()` accepts and gives a `PresetConfig`.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from collections.abc import Mapping

from keras_hub_autodist import compat
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.reading.configs import CONFIG_FILE
from keras_hub_autodist.reading.configs import PresetConfig
from keras_hub_autodist.reading.configs import check_config_object
from keras_hub_autodist.reading.configs import config_dict_kind
from keras_hub_autodist.reading.configs import config_dict_label
from keras_hub_autodist.reading.configs import keras_config
from keras_hub_autodist.reading.configs import missing_hf_field
from keras_hub_autodist.reading.configs import read_local_config
from keras_hub_autodist.reading.configs import read_local_config_dict
from keras_hub_autodist.reading.configs import reject_vision_towers
from keras_hub_autodist.reading.configs import store_conversion
from keras_hub_autodist.reading.network import check_hugging_face_reachable


def _not_a_string(preset) -> PresetError:
    return PresetError(
        "A preset is a string: a local folder, `hf://owner/name`, "
        "`kaggle://owner/model/keras/variation[/version]` or a built-in "
        f"preset name. Received: preset={preset!r} of type "
        f"{type(preset).__name__}"
    )


def _loader_for(preset):
    if not isinstance(preset, str):
        raise _not_a_string(preset)
    read_local_config(preset)  # a local config.json's problems, named
    if preset.lower().startswith("kaggle://"):
        check_kaggle_handle(preset)
    try:
        check_hugging_face_reachable(preset)  # fails fast: no 35 s of retries
        return compat.preset_loader(preset)
    except Exception as error:
        if is_network_error(error):
            raise PresetError(
                f"Can't download `{CONFIG_FILE}` of the preset: the network "
                "is unreachable. Connect, or pass a local folder holding the "
                f"preset's `{CONFIG_FILE}` (e.g. saved with `save_to_preset`, "
                "or a Hugging Face checkpoint folder). Received: "
                f"preset={preset!r} ({type(error).__name__})"
            ) from error
        if isinstance(error, FileNotFoundError):
            raise PresetError(
                f"The preset has no `{CONFIG_FILE}`, which planning needs. "
                "Point to a folder (or handle) holding a Keras preset saved "
                "with `save_to_preset` or a Hugging Face checkpoint with its "
                f"`{CONFIG_FILE}`. Received: preset={preset!r} ({error})"
            ) from error
        if isinstance(error, ValueError) and (
            "no config.json" in str(error) or "Unknown preset" in str(error)
        ):
            if not os.path.exists(os.path.expanduser(preset)):
                raise _no_such_folder(preset) from error
            raise PresetError(
                f"Can't read `{CONFIG_FILE}` from the preset. Pass a folder "
                f"that contains `{CONFIG_FILE}`, an `hf://` or `kaggle://` "
                "handle, or a built-in preset name. Received: "
                f"preset={preset!r}"
            ) from error
        if isinstance(error, ValueError) and "has no converter" in str(error):
            found = re.search(r"model type `(.+?)`", str(error))
            model_type = found.group(1) if found else "(unknown)"
            raise _unconvertible(preset, model_type) from error
        if isinstance(error, ValueError) and "Unrecognized format" in str(error):
            raise _neither_format(preset) from error
        if isinstance(error, json.JSONDecodeError):
            raise PresetError(
                f"The preset's `{CONFIG_FILE}` is not valid JSON ({error}). "
                f"Fix or replace the file. Received: preset={preset!r}"
            ) from error
        if isinstance(error, TypeError):
            # keras-hub looks keys up in the config before anything else: a
            # `config.json` holding null, a list or a number fails there.
            raise ConfigError(
                f"The preset's `{CONFIG_FILE}` is not a JSON object of the "
                f"backbone's configuration ({error}). Save the model again "
                "with `save_to_preset`, or restore the file. Received: "
                f"preset={preset!r}"
            ) from error
        raise


def _no_such_folder(preset: str) -> PresetError:
    """A preset that is no folder here, nor a handle or built-in name."""
    as_path = os.path.abspath(os.path.expanduser(preset))
    return PresetError(
        f"No such folder: {as_path!r}, and {preset!r} is no `hf://` or "
        "`kaggle://` handle nor a built-in preset name either. Check the "
        "path (relative paths start from the current directory, "
        f"{os.getcwd()!r}), or pass a handle or a built-in name such as "
        f"'gemma_2b_en'. Received: preset={preset!r}"
    )


def _unconvertible(preset, model_type) -> UnsupportedArchitectureError:
    """A Hugging Face checkpoint whose `model_type` keras-hub can't convert."""
    return UnsupportedArchitectureError(
        f"keras-hub has no converter for Hugging Face model_type={model_type}, "
        "so no keras-hub backbone exists for this checkpoint. Use a checkpoint "
        "of a model type keras-hub converts (gemma, llama, mistral, qwen2, "
        "...; see keras-hub's `keras_hub/src/utils/transformers`), or a Keras "
        f"preset saved with `save_to_preset`. Received: preset={preset!r}"
    )


def read_preset_config(preset: str) -> PresetConfig:
    """Read the backbone class and config of `preset` with keras-hub.

    This imports keras-hub; `read_local_config` reads local folders of the
    known families without it.

    Args:
        preset: anything `keras_hub.models.Backbone.from_preset` accepts.

    Returns:
        A `PresetConfig`.

    Example:
    ```python
    info = read_preset_config("./gemma_2b")
    info.backbone_cls.__name__, info.config["num_key_value_heads"]
    ```
    """
    loader = _loader_for(preset)
    return _config_from_loader(loader, loader.config, preset)


def _config_from_loader(loader, raw: Mapping, preset) -> PresetConfig:
    check_config_object(raw, CONFIG_FILE, preset)
    if "registered_name" in raw:
        try:
            backbone_cls = loader.check_backbone_class()
        except ValueError as error:
            raise UnsupportedArchitectureError(
                f"No class is registered with Keras as "
                f"{raw['registered_name']!r}, the class the preset's "
                f"`{CONFIG_FILE}` names: import the package that defines it "
                "first, or fix `registered_name`. Received: "
                f"registered_name={raw['registered_name']!r} in preset={preset!r}"
            ) from error
        return PresetConfig(preset, backbone_cls, keras_config(raw, preset), "keras")
    if "model_type" in raw:
        reject_vision_towers(raw, preset)
        converter = loader.converter
        backbone_cls = loader.check_backbone_class()
        convert = converter.convert_backbone_config
        from keras_hub_autodist.compat import deferred_variables

        try:
            # Converters may build sub-models (Gemma 3's vision encoder):
            # their variables get shapes, never values.
            with deferred_variables():
                if len(inspect.signature(convert).parameters) != 1:
                    config = convert(raw, backbone_cls)
                else:
                    config = convert(raw)
        except KeyError as error:
            raise missing_hf_field(error.args[0], raw, preset) from error
        store_conversion(raw, backbone_cls.__name__, config)
        return PresetConfig(preset, backbone_cls, dict(config), "transformers")
    raise _neither_format(preset)


def _neither_format(preset) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"The preset's `{CONFIG_FILE}` is neither a Keras preset config nor a "
        "Hugging Face transformers config. Save the model with "
        "`save_to_preset`, or pass a transformers checkpoint folder. "
        f"Received: preset={preset!r}"
    )


def read_config_dict(raw: Mapping) -> PresetConfig:
    """Read a config dict with keras-hub: the backbone class is resolved.

    Keras preset dicts are resolved through their `registered_name`,
    `class_name` strings among keras-hub's backbones, and Hugging Face dicts
    are converted by keras-hub's converter for their `model_type`, exactly
    as `from_preset` would for a folder holding that `config.json`.

    Args:
        raw: the config dict (see `config_dict_kind`); it is not modified.

    Example:
    ```python
    read_config_dict(json.load(open("gemma_2b/config.json"))).backbone_cls
    ```
    """
    kind = config_dict_kind(raw)
    label = config_dict_label(raw)
    import keras
    import keras_hub  # noqa: F401  (registers keras-hub's classes)

    if kind == "class":
        info = read_local_config_dict(raw)
        if info.backbone_cls is not None:
            return info
        name = info.backbone_class
        cls = keras.saving.get_registered_object(f"keras_hub>{name}")
        if cls is None:
            raise PlanInputError(
                f"keras-hub has no backbone class named {name!r}. Give the "
                "class itself, {'class_name': MyBackbone, 'config': ...}, or "
                "pass the backbone instance. Received: "
                f"class_name={name!r} in preset={label!r}"
            )
        return PresetConfig(label, cls, info.config, "keras")
    if kind == "keras":
        loader = compat.keras_preset_loader(label, dict(raw))
        try:
            cls = loader.check_backbone_class()
        except ValueError as error:
            raise PlanInputError(
                f"No class is registered with Keras as "
                f"{raw['registered_name']!r}: import the package that "
                "defines it first, or pass the backbone instance. Received: "
                f"registered_name={raw['registered_name']!r} in "
                f"preset={label!r}"
            ) from error
        return PresetConfig(label, cls, keras_config(raw, label), "keras")
    reject_vision_towers(raw, label)
    try:
        loader = compat.transformers_preset_loader(label, dict(raw))
    except ValueError as error:
        raise _unconvertible(label, repr(raw["model_type"])) from error
    return _config_from_loader(loader, raw, label)


def check_kaggle_handle(preset: str) -> str:
    """The handle of a `kaggle://` preset, whose segments must be names.

    Segments are joined into paths below kagglehub's cache, so `..`, `.`,
    empty segments and backslashes are rejected.

    Raises:
        PresetError: for a segment that is not a plain name.

    Example:
    >>> check_kaggle_handle("kaggle://keras/gemma/keras/gemma_2b_en/2")
    'keras/gemma/keras/gemma_2b_en/2'
    """
    handle_text = preset.split("://", 1)[1]
    for segment in handle_text.split("/"):
        if segment in ("", ".", "..") or "\\" in segment:
            raise PresetError(
                "Each segment of a Kaggle handle is a name: "
                "kaggle://owner/model/framework/variation[/version]; `..`, "
                "`.`, empty segments and backslashes would leave kagglehub's "
                f"cache. Received: preset={preset!r}"
            )
    return handle_text


def cached_kaggle_snapshot(preset: str) -> str | None:
    """The local folder kagglehub cached a versioned `kaggle://` preset in.

    kagglehub has no offline switch, and keras-hub probes optional files
    (e.g. `task.weights.h5`) over the network, so a fully cached Kaggle
    preset still fails to load offline. When its `config.json` is in
    kagglehub's cache, this returns the cache folder, which loads offline
    like a local preset. Returns `None` otherwise.

    Example:
    ```python
    cached_kaggle_snapshot("kaggle://keras/gemma/keras/gemma_2b_en/2")
    ```
    """
    if not isinstance(preset, str) or not preset.lower().startswith("kaggle://"):
        return None
    handle_text = check_kaggle_handle(preset)
    if len(handle_text.split("/")) != 5:  # unversioned handles need the API
        return None
    try:
        from kagglehub import cache
        from kagglehub.handle import parse_model_handle
    except ImportError:
        return None
    handle = parse_model_handle(handle_text)
    if cache.Cache().load_from_cache(handle, CONFIG_FILE) is None:
        return None
    return cache.get_cached_path(handle)


def is_network_error(error: BaseException) -> bool:
    """True for connection errors raised by requests/urllib3 or the OS.

    Example:
    >>> is_network_error(ConnectionRefusedError())
    True
    """
    for cause in (error, error.__cause__, error.__context__):
        if cause is None:
            continue
        if isinstance(cause, ConnectionError) or type(cause).__name__ in (
            "ConnectionError",
            "NameResolutionError",
            "MaxRetryError",
        ):
            return True
    return False


def _path_string(path: os.PathLike) -> str:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    # A path object is a folder: spell it as one, never as a preset name.
    if not os.path.isabs(text) and not text.startswith((".", "~")):
        text = os.path.join(os.curdir, text)
    return text


def _instance_config(model) -> PresetConfig:
    """The backbone class and config of a keras-hub backbone or task."""
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
    return PresetConfig(label, type(backbone), config, "keras")


def read_config(preset) -> PresetConfig:
    """The config to plan, read without keras-hub whenever possible.

    Local folders and config dicts of keras-hub backbones are read without
    Keras (`configs.read_local_config`, `configs.read_local_config_dict`:
    the result names the backbone class, which the weights step resolves);
    anything else goes through keras-hub's loaders (`read_preset_config`,
    `read_config_dict`). A backbone (or task) instance gives its class and
    `get_config()`.

    Args:
        preset: as for `plan()`.

    Example:
    ```python
    read_config("./gemma_2b").backbone_class
    ```
    """
    if isinstance(preset, os.PathLike):
        preset = _path_string(preset)
    if isinstance(preset, str):
        info = read_local_config(preset)
        return info if info is not None else read_preset_config(preset)
    if isinstance(preset, Mapping):
        info = read_local_config_dict(preset)
        return info if info is not None else read_config_dict(preset)
    return _instance_config(preset)
