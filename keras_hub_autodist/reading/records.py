"""The values reading passes from step to step, the names they use, and
what a `config.json` must be (a JSON object of one of two formats), which
both steps check.

Reading a preset walks one way: the source (a folder, a handle, a config
dict, a model instance) is read into a `ConfigSource` (`sources.py`), whose
raw config becomes a `PresetConfig` (`configs.py`), the first value of the
planning path. Nothing here reads a file or imports Keras.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import UnsupportedArchitectureError

CONFIG_FILE = "config.json"

# How a plan made from a config dict names its source.
CONFIG_DICT = "<config dict>"
HF_CONFIG_DICT = "<Hugging Face config dict>"


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


@dataclasses.dataclass(frozen=True)
class ConfigSource:
    """A preset's source, read as far as it can be without keras-hub.

    Args:
        preset: how the plan names the source: the path or handle as
            given, or a label such as `"<config dict>"`.
        raw: the source's config: a `config.json`'s contents, a config
            dict, or `{"class_name": cls, "config": ...}` of a model
            instance; `None` when only keras-hub can read it (a handle, a
            built-in name).
        dict_kind: for a config dict (or a model instance, read as one),
            its form: `"keras"`, `"class"` or `"transformers"`, as
            `sources.config_dict_kind` says; `""` for a preset string,
            which keras-hub's preset loader reads when keras-hub is needed
            (a dict is read by the loader of its form).
        folder: the local folder the preset is, if it is one: its weights
            say whether a config that leaves out tying is tied.

    Example:
    >>> ConfigSource("<config dict>", {"model_type": "llama"},
    ...     "transformers").folder is None
    True
    """

    preset: str
    raw: Mapping | None
    dict_kind: str = ""
    folder: str | None = None


def neither_format_error(preset) -> UnsupportedArchitectureError:
    """A `config.json` that is neither a Keras preset's nor a Hugging Face
    checkpoint's."""
    return UnsupportedArchitectureError(
        f"The preset's `{CONFIG_FILE}` is neither a Keras preset config nor a "
        "Hugging Face transformers config. Save the model with "
        "`save_to_preset`, or pass a transformers checkpoint folder. "
        f"Received: preset={preset!r}"
    )


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
