"""What a preset's config says, read without Keras or keras-hub.

A `PresetConfig` is the first value of the data path: the backbone class (or
its name) and the constructor arguments `from_preset` will build from. This
module reads the forms that need neither Keras nor keras-hub (importing them
takes seconds):

- a local folder's `config.json`: a Keras preset's as is, a Hugging Face
  one converted with the field table `HF_CONVERSIONS`, which mirrors
  keras-hub's converters (a test compares the two on every config the tests
  carry);
- a config dict (the contents of a `config.json`, or a backbone's
  `get_config()` with its class).

Anything else (handles, built-in names, other model types) is read through
keras-hub's own loaders in `presets.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from collections.abc import Mapping

from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError

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
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"The `config` entry of the preset's `{CONFIG_FILE}` must be a "
            "mapping of the backbone's arguments. Save the model again with "
            f"`save_to_preset`. Received: config={config!r} in "
            f"preset={preset!r}"
        )
    return dict(config)


def missing_hf_field(field, raw: Mapping, preset) -> ConfigError:
    return ConfigError(
        f"The Hugging Face `{CONFIG_FILE}` (model_type="
        f"{raw.get('model_type')!r}) has no `{field}`, which the conversion "
        "to a keras-hub config needs. Add the field (see the model's "
        f"original config). Received: preset={preset!r}"
    )


# --- The fast path: local folders, without Keras or keras-hub. -------------

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class HFConversion:
    """How keras-hub converts one Hugging Face `model_type` to a backbone.

    Args:
        backbone_class: the keras-hub backbone class name the converter
            builds (`backbone_cls` of its `convert_*.py` module).
        fields: `(keras field, Hugging Face field, default)` triples;
            `default` is `REQUIRED` when keras-hub reads the field with `[]`.
        constants: keras fields the converter always sets.
        derived: keras field → function of the Hugging Face config.
    """

    backbone_class: str
    fields: tuple[tuple[str, str, object], ...]
    constants: Mapping = dataclasses.field(default_factory=dict)
    derived: Mapping[str, Callable[[Mapping], object]] = dataclasses.field(
        default_factory=dict
    )


REQUIRED = _REQUIRED

_LLAMA_FAMILY_FIELDS = (
    ("vocabulary_size", "vocab_size", REQUIRED),
    ("num_layers", "num_hidden_layers", REQUIRED),
    ("num_query_heads", "num_attention_heads", REQUIRED),
    ("hidden_dim", "hidden_size", REQUIRED),
    ("intermediate_dim", "intermediate_size", REQUIRED),
    ("num_key_value_heads", "num_key_value_heads", REQUIRED),
)
_GEMMA_FIELDS = (
    ("vocabulary_size", "vocab_size", REQUIRED),
    ("num_layers", "num_hidden_layers", REQUIRED),
    ("num_query_heads", "num_attention_heads", REQUIRED),
    ("num_key_value_heads", "num_key_value_heads", REQUIRED),
    ("hidden_dim", "hidden_size", REQUIRED),
    ("head_dim", "head_dim", REQUIRED),
)


def _rope_theta(hf: Mapping):
    theta = (hf.get("rope_parameters") or {}).get("rope_theta")
    return hf["rope_theta"] if theta is None else theta


def _gated_intermediate(hf: Mapping):
    # keras-hub's Gemma counts both gated projections in intermediate_dim.
    # Anything but an int is passed on as is, for validation to name it.
    size = hf["intermediate_size"]
    return size * 2 if isinstance(size, int) and size > 0 else size


# The Keras config keras-hub's converters (keras_hub/src/utils/transformers/
# convert_{gemma,gemma3,llama3,mistral}.py) produce, restricted to the fields
# that shape the weights plus their plain renames. Kept as data; the test
# `test_fast_reader_agrees_with_keras_hub` catches drift.
HF_CONVERSIONS: dict[str, HFConversion] = {
    "gemma": HFConversion(
        "GemmaBackbone",
        _GEMMA_FIELDS,
        derived={"intermediate_dim": _gated_intermediate},
    ),
    "gemma2": HFConversion(
        "GemmaBackbone",
        _GEMMA_FIELDS
        + (
            ("final_logit_soft_cap", "final_logit_softcapping", REQUIRED),
            ("attention_logit_soft_cap", "attn_logit_softcapping", REQUIRED),
            ("sliding_window_size", "sliding_window", REQUIRED),
        ),
        constants={
            "use_post_ffw_norm": True,
            "use_post_attention_norm": True,
            "use_sliding_window_attention": True,
        },
        derived={
            "intermediate_dim": _gated_intermediate,
            "query_head_dim_normalize": lambda hf: (
                hf["head_dim"] == hf["query_pre_attn_scalar"]
            ),
        },
    ),
    "gemma3_text": HFConversion(
        "Gemma3Backbone",
        (
            ("vocabulary_size", "vocab_size", 262144),
            ("num_layers", "num_hidden_layers", REQUIRED),
            ("num_query_heads", "num_attention_heads", 8),
            ("num_key_value_heads", "num_key_value_heads", 4),
            ("hidden_dim", "hidden_size", REQUIRED),
            ("intermediate_dim", "intermediate_size", REQUIRED),
            ("head_dim", "head_dim", REQUIRED),
            ("use_post_ffw_norm", "use_post_ffw_norm", True),
            ("use_post_attention_norm", "use_post_attention_norm", True),
            ("attention_logit_soft_cap", "attn_logit_softcapping", None),
            ("final_logit_soft_cap", "final_logit_softcapping", None),
            ("layer_norm_epsilon", "rms_norm_eps", 1e-6),
            ("use_bidirectional_attention", "use_bidirectional_attention", False),
            ("is_embedding_model", "use_bidirectional_attention", False),
            ("use_query_key_norm", "use_query_key_norm", True),
        ),
        constants={"image_size": None, "vision_encoder": None},
    ),
    "llama": HFConversion(
        "Llama3Backbone",
        _LLAMA_FAMILY_FIELDS
        + (("tie_word_embeddings", "tie_word_embeddings", REQUIRED),),
        derived={"rope_max_wavelength": _rope_theta},
    ),
    "mistral": HFConversion(
        "MistralBackbone",
        _LLAMA_FAMILY_FIELDS
        + (
            ("layer_norm_epsilon", "rms_norm_eps", REQUIRED),
            ("sliding_window", "sliding_window", None),
            ("head_dim", "head_dim", None),
        ),
        derived={"rope_max_wavelength": _rope_theta},
    ),
}


def convert_hf_config(raw: Mapping, preset: str = "") -> tuple[str, dict]:
    """The backbone class name and Keras config of a Hugging Face config.

    Only for the model types in `HF_CONVERSIONS`; no Keras or keras-hub is
    imported.

    Args:
        raw: the Hugging Face `config.json`, as a dict.
        preset: the preset, for messages.

    Returns:
        `(backbone class name, config)`.

    Example:
    >>> convert_hf_config({"model_type": "llama", "vocab_size": 8,
    ...     "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 4,
    ...     "intermediate_size": 8, "num_key_value_heads": 1,
    ...     "tie_word_embeddings": False, "rope_theta": 1e4})[1]["hidden_dim"]
    4
    """
    model_type = raw.get("model_type")
    conversion = HF_CONVERSIONS.get(model_type)
    if conversion is None:
        raise UnsupportedArchitectureError(
            f"No fast conversion for Hugging Face model_type={model_type!r}; "
            f"known: {sorted(HF_CONVERSIONS)}. Received: preset={preset!r}"
        )
    config = {}
    try:
        for keras_name, hf_name, default in conversion.fields:
            if default is REQUIRED:
                config[keras_name] = raw[hf_name]
            else:
                config[keras_name] = raw.get(hf_name, default)
        config.update(conversion.constants)
        for keras_name, derive in conversion.derived.items():
            config[keras_name] = derive(raw)
    except KeyError as error:
        raise missing_hf_field(error.args[0], raw, preset) from error
    except TypeError as error:
        raise ConfigError(
            f"A field of the Hugging Face `{CONFIG_FILE}` has the wrong type "
            f"({error}). Fix the file. Received: preset={preset!r}"
        ) from error
    return conversion.backbone_class, config


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
    checkpoints whose `model_type` is in `HF_CONVERSIONS`. Returns `None`
    for anything else (handles, built-in names, other formats), which
    `read_preset_config` reads through keras-hub. The result has
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
        if raw["model_type"] not in HF_CONVERSIONS or "vision_config" in raw:
            # keras-hub's converter reads it, unless an earlier process did.
            return _stored_conversion(raw, preset)
        name, config = convert_hf_config(raw, preset)
        return PresetConfig(preset, None, config, "transformers", name)
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
    from keras_hub_autodist import abstract

    key = _conversion_key(raw)
    if key is not None:
        abstract.store("conversion", key, {"class": class_name, "config": config})


def _stored_conversion(raw: Mapping, preset) -> PresetConfig | None:
    from keras_hub_autodist import abstract

    key = _conversion_key(raw)
    stored = abstract.read_stored("conversion", key) if key is not None else None
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
    `model_type` not in `HF_CONVERSIONS`); `read_config_dict` reads those.

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
    if raw["model_type"] not in HF_CONVERSIONS or "vision_config" in raw:
        return None
    name, config = convert_hf_config(raw, label)
    return PresetConfig(label, None, config, "transformers", name)
