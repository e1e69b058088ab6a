"""Read a preset's backbone class and config: the entry of the data path.

Reading walks one way, a step a module: the source (a folder, `hf://`,
`kaggle://`, a built-in name, a config dict, a model instance) is read into
a `ConfigSource` (`sources.py`), whose raw config becomes a `PresetConfig`
(`configs.py`), without keras-hub whenever it can, else through keras-hub's
own loader (`loaders.py`) and converters, so that planning sees exactly the
config `from_preset` will build from. Only `config.json` is read.
`read_config` takes anything `plan()` accepts.
"""

from __future__ import annotations

from collections.abc import Mapping

from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.reading.configs import ALWAYS
from keras_hub_autodist.reading.configs import NEVER
from keras_hub_autodist.reading.configs import preset_config
from keras_hub_autodist.reading.records import PresetConfig
from keras_hub_autodist.reading.sources import dict_source
from keras_hub_autodist.reading.sources import read_source


def read_config(preset) -> PresetConfig:
    """The config to plan, read without keras-hub whenever possible.

    Local folders and config dicts of keras-hub backbones are read without
    Keras (the result names the backbone class, which the weights step
    resolves); anything else goes through keras-hub's loaders. A backbone
    (or task) instance gives its class and `get_config()`.

    Args:
        preset: as for `plan()`.

    Example:
    ```python
    read_config("./gemma_2b").backbone_class
    ```
    """
    source = read_source(preset)
    return preset_config(source)


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
    if not isinstance(preset, str):
        raise PresetError(
            "A preset is a string: a local folder, `hf://owner/name`, "
            "`kaggle://owner/model/keras/variation[/version]` or a built-in "
            f"preset name. Received: preset={preset!r} of type "
            f"{type(preset).__name__}"
        )
    source = read_source(preset)
    return preset_config(source, keras_hub=ALWAYS)


def read_config_dict(raw: Mapping) -> PresetConfig:
    """Read a config dict with keras-hub: the backbone class is resolved.

    Keras preset dicts are resolved through their `registered_name`,
    `class_name` strings among keras-hub's backbones, and Hugging Face dicts
    are converted by keras-hub's converter for their `model_type`, exactly
    as `from_preset` would for a folder holding that `config.json`.

    Args:
        raw: the config dict (see `sources.config_dict_kind`); it is not
            modified.

    Example:
    ```python
    read_config_dict(json.load(open("gemma_2b/config.json"))).backbone_cls
    ```
    """
    source = dict_source(raw)
    return preset_config(source, keras_hub=ALWAYS)


def read_local_config(preset: str) -> PresetConfig | None:
    """Read a local preset folder's config without Keras or keras-hub.

    Covers Keras presets of `keras_hub>` backbones and Hugging Face
    checkpoints whose config keras-hub converted in an earlier process.
    Returns `None` for anything else (handles, built-in names, configs not
    converted yet), which `read_preset_config` reads through keras-hub. The
    result has `backbone_cls=None` and the class name in `backbone_class`.

    Args:
        preset: a local folder.

    Example:
    ```python
    info = read_local_config("./gemma_2b")
    info.backbone_class, info.config["num_key_value_heads"]
    ```
    """
    if not isinstance(preset, str):
        return None
    source = read_source(preset)
    return preset_config(source, keras_hub=NEVER)
