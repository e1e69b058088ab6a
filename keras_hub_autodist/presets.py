"""Read a preset's backbone class and config without building the model.

It uses keras-hub's own preset loaders (local folders, `hf://`, `kaggle://`,
built-in names; reached through `compat`) and its Hugging Face → Keras config
converters, so that planning sees exactly the config `from_preset` will build
from. Only `config.json` is read.

Local folders of the families the planner knows also have a fast path,
`read_local_config`, that needs neither Keras nor keras-hub (importing them
takes seconds): a Keras `config.json` is read as is, a Hugging Face one is
converted with the field table `HF_CONVERSIONS`, which mirrors keras-hub's
converters (a test compares the two on every config the tests carry).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Callable
from collections.abc import Mapping

from keras_hub_autodist import compat
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import DTypeError
from keras_hub_autodist.errors import PlanInputError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.network import check_hugging_face_reachable

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
            raise PresetError(
                f"Can't read `{CONFIG_FILE}` from the preset. Pass a folder "
                f"that contains `{CONFIG_FILE}`, an `hf://` or `kaggle://` "
                "handle, or a built-in preset name. Received: "
                f"preset={preset!r}"
            ) from error
        if isinstance(error, json.JSONDecodeError):
            raise PresetError(
                f"The preset's `{CONFIG_FILE}` is not valid JSON ({error}). "
                f"Fix or replace the file. Received: preset={preset!r}"
            ) from error
        raise


# Hugging Face model types whose vision tower is planned (keras-hub
# converts it); other checkpoints with a `vision_config` are refused.
VISION_TOWER_MODEL_TYPES = ("gemma3",)


def _reject_vision_towers(raw: Mapping, preset) -> None:
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


def _keras_config(raw: Mapping, preset) -> dict:
    config = raw.get("config")
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"The `config` entry of the preset's `{CONFIG_FILE}` must be a "
            "mapping of the backbone's arguments. Save the model again with "
            f"`save_to_preset`. Received: config={config!r} in "
            f"preset={preset!r}"
        )
    return dict(config)


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
    if "registered_name" in raw:
        backbone_cls = loader.check_backbone_class()
        return PresetConfig(preset, backbone_cls, _keras_config(raw, preset), "keras")
    if "model_type" in raw:
        _reject_vision_towers(raw, preset)
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
            raise _missing_hf_field(error.args[0], raw, preset) from error
        _store_conversion(raw, backbone_cls.__name__, config)
        return PresetConfig(preset, backbone_cls, dict(config), "transformers")
    raise UnsupportedArchitectureError(
        f"The preset's `{CONFIG_FILE}` is neither a Keras preset config nor a "
        "Hugging Face transformers config. Save the model with "
        "`save_to_preset`, or pass a transformers checkpoint folder. "
        f"Received: preset={preset!r}"
    )


def _missing_hf_field(field, raw: Mapping, preset) -> ConfigError:
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
    return size * 2 if _is_positive_int(size) else size


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
        raise _missing_hf_field(error.args[0], raw, preset) from error
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # keras-hub's loader reports it
    if not isinstance(raw, Mapping):
        return None
    if "registered_name" in raw:
        package, _, name = str(raw["registered_name"]).partition(">")
        if package != "keras_hub" or not name:
            return None
        return PresetConfig(preset, None, _keras_config(raw, preset), "keras", name)
    if "model_type" in raw:
        _reject_vision_towers(raw, preset)
        if raw["model_type"] not in HF_CONVERSIONS or "vision_config" in raw:
            # keras-hub's converter reads it, unless an earlier process did.
            return _stored_conversion(raw, preset)
        name, config = convert_hf_config(raw, preset)
        return PresetConfig(preset, None, config, "transformers", name)
    return None


def _conversion_key(raw: Mapping) -> str | None:
    try:
        return json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError):
        return None


def _store_conversion(raw: Mapping, class_name: str, config: Mapping) -> None:
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
        return PresetConfig(label, None, _keras_config(raw, label), "keras", name)
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
    _reject_vision_towers(raw, label)
    if raw["model_type"] not in HF_CONVERSIONS or "vision_config" in raw:
        return None
    name, config = convert_hf_config(raw, label)
    return PresetConfig(label, None, config, "transformers", name)


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
        return PresetConfig(label, cls, _keras_config(raw, label), "keras")
    _reject_vision_towers(raw, label)
    try:
        loader = compat.transformers_preset_loader(label, dict(raw))
    except ValueError as error:
        raise UnsupportedArchitectureError(
            "keras-hub has no converter for Hugging Face "
            f"model_type={raw['model_type']!r}, so no keras-hub backbone "
            f"exists for it. Received: preset={label!r}"
        ) from error
    return _config_from_loader(loader, raw, label)


# --- Validation of the fields the architectures read. ----------------------


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _received(preset_config: PresetConfig, field: str, value) -> str:
    return f"Received: {field}={value!r} in preset={str(preset_config.preset)!r}"


def validate_config(preset_config: PresetConfig, fields) -> None:
    """Check the config fields an architecture uses before planning.

    Every field in `fields` that is set (not `None`) must be a positive
    integer, and `num_query_heads` must be a multiple of
    `num_key_value_heads`, as keras-hub's attention layers require.

    Args:
        preset_config: the config read from the preset.
        fields: the names of the structural fields (e.g. `num_layers`,
            `hidden_dim`) of the architecture.

    Raises:
        ConfigError: naming the field, its value and the preset.

    Example:
    >>> info = PresetConfig("./p", None, {"num_layers": -1}, "keras", "X")
    >>> validate_config(info, ["num_layers"])
    Traceback (most recent call last):
    ...
    keras_hub_autodist.errors.ConfigError: The preset's config has `num_layers=-1`; it must be a positive integer. Fix the preset's config.json. Received: num_layers=-1 in preset='./p'
    """  # noqa: E501
    config = preset_config.config
    if not isinstance(config, Mapping):
        raise ConfigError(
            "A backbone config is a mapping of constructor arguments. "
            f"Received: config={config!r} in preset={preset_config.preset!r}"
        )
    for field in fields:
        value = config.get(field)
        if value is not None and not _is_positive_int(value):
            raise ConfigError(
                f"The preset's config has `{field}={value!r}`; it must be a "
                "positive integer. Fix the preset's config.json. "
                + _received(preset_config, field, value)
            )
    heads = config.get("num_query_heads")
    kv_heads = config.get("num_key_value_heads")
    if _is_positive_int(heads) and _is_positive_int(kv_heads) and heads % kv_heads:
        raise ConfigError(
            f"`num_query_heads={heads}` is not a multiple of "
            f"`num_key_value_heads={kv_heads}`: each key/value head serves a "
            "whole group of query heads in keras-hub's attention. Fix the "
            "preset's config.json. "
            + _received(preset_config, "num_key_value_heads", kv_heads)
        )


# Where planning takes weight shapes from: the model, built abstractly
# (`"model"`, the default), or the family's keras-free `shape_hints` where it
# has them (`"config"`: the CLI's fast path, which must not import keras-hub).
_SHAPE_SOURCE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "keras_hub_autodist_shape_source", default="model"
)


@contextlib.contextmanager
def shapes_from_config():
    """Plan with the families' keras-free shape hints where they exist.

    The CLI plans local configs of the built-in families this way, without
    importing keras-hub; tests check every hint against the abstract build.

    Example:
    ```python
    with shapes_from_config():
        plan("./gemma_2b", {"batch": 2, "model": 4})
    ```
    """
    token = _SHAPE_SOURCE.set("config")
    try:
        yield
    finally:
        _SHAPE_SOURCE.reset(token)


def backbone_class_named(name: str) -> type:
    """The keras-hub backbone class registered under `name`.

    Example:
    >>> backbone_class_named("GemmaBackbone").__name__
    'GemmaBackbone'
    """
    import keras
    import keras_hub

    found = keras.saving.get_registered_object(f"keras_hub>{name}")
    if found is None:
        found = getattr(keras_hub.models, name, None)
    if found is None:  # another package's backbone, registered with Keras
        registered = keras.saving.get_custom_objects()
        found = next(
            (obj for key, obj in registered.items() if key.endswith(f">{name}")),
            None,
        )
    if not isinstance(found, type):
        raise ConfigError(
            f"keras-hub has no backbone class named {name!r}. Check the "
            "preset's config.json `class_name` (or upgrade keras-hub). "
            f"Received: class_name={name!r}"
        )
    return found


def _model_weights(handler, preset_config: PresetConfig, strict: bool):
    config = preset_config.config
    if not getattr(handler, "rules", ()):
        # A handler that lists its weights itself (the table-less interface).
        return handler.weights(config)
    if preset_config.backbone_cls is None:
        if _SHAPE_SOURCE.get() == "config":
            hints = handler.shape_hints(config)
            if hints is not None:
                return [_under_rule(handler, hint) for hint in hints]
        # An earlier process's abstract build of this config, without keras.
        from keras_hub_autodist.abstract import stored_variables

        stored = stored_variables(preset_config.backbone_class, config)
        if stored is not None:
            return handler.weights_from(
                stored, config, preset_config.backbone_class, strict=strict
            )
    backbone_cls = preset_config.backbone_cls or backbone_class_named(
        preset_config.backbone_class
    )
    return handler.weights(config, backbone_cls, strict=strict)


def _under_rule(handler, hint):
    """A hinted weight keyed by the rule that matches it, as the model's is."""
    rules = handler.matching_rules(hint.path)
    if len(rules) != 1:
        return hint
    return dataclasses.replace(hint, pattern=rules[0].pattern)


def validated_weights(
    handler, preset_config: PresetConfig, fields: Mapping, *, strict: bool = True
):
    """The weights of the preset's model, with config problems as `ConfigError`.

    Shapes and paths come from the model built abstractly from the config
    (`Architecture.weights`), or from the family's shape hints inside
    `shapes_from_config()`. A field the family needs but the config lacks,
    and a weight with a dimension that is not a positive integer, name the
    field and the preset.

    Args:
        handler: the architecture.
        preset_config: the config read from the preset.
        fields: the handler's `config_fields` (logical axis → config field).
        strict: a weight that matches no rule is an error (`True`) or a
            warning, the weight staying replicated (`False`).
    """
    config = preset_config.config
    try:
        weights = _model_weights(handler, preset_config, strict)
    except KeyError as error:
        raise _missing_field_error(handler, preset_config, error) from error
    except ConfigError as error:
        # keras-hub could not build the model: name the field when the
        # family's shape hints can tell which one is wrong.
        try:
            hints = handler.shape_hints(config)
        except KeyError as missing:
            raise _missing_field_error(handler, preset_config, missing) from error
        except Exception:  # the hints can't tell either
            raise error from None
        if hints is None:
            raise
        _check_positive_dims(hints, preset_config, fields)
        raise
    _check_positive_dims(weights, preset_config, fields)
    return weights


def _missing_field_error(handler, preset_config, error: KeyError) -> ConfigError:
    field = error.args[0] if error.args else "?"
    return ConfigError(
        f"The preset's config has no `{field}`, which the "
        f"{handler.name} layout needs. Add it to the preset's "
        f"config.json. Received: preset={str(preset_config.preset)!r}, "
        f"fields={sorted(preset_config.config)}"
    )


def _check_positive_dims(weights, preset_config: PresetConfig, fields) -> None:
    config = preset_config.config
    for weight in weights:
        for size, axis in zip(weight.shape, weight.axes):
            if not _is_positive_int(size):
                field = fields.get(axis, axis)
                raise ConfigError(
                    f"The preset's config gives weight {weight.path!r} the "
                    f"shape {weight.shape}: its {axis} dimension (from "
                    f"`{field}`) must be a positive integer. Fix `{field}` in "
                    "the preset's config.json. "
                    + _received(preset_config, field, config.get(field))
                )


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def floatx() -> str:
    """Keras' `floatx()`, read from `keras.json` while Keras isn't imported.

    Example:
    >>> floatx() in ("float16", "float32", "float64")
    True
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        return keras.config.floatx()
    if "KERAS_HOME" in os.environ:
        folder = os.environ["KERAS_HOME"]
    else:
        folder = os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(folder, "keras.json"), encoding="utf-8") as file:
            value = json.load(file).get("floatx", "float32")
    except (OSError, ValueError, AttributeError):
        return "float32"
    return value if value in ("float16", "float32", "float64") else "float32"


def _policy_name(policy):
    """The name of a simple policy given as a string or Keras' serialized
    form; `None` for anything Keras must interpret."""
    if isinstance(policy, str):
        return policy
    if (
        isinstance(policy, Mapping)
        and policy.get("module") == "keras"
        and policy.get("class_name") == "DTypePolicy"
        and isinstance(policy.get("config"), Mapping)
        and isinstance(policy["config"].get("name"), str)
    ):
        return policy["config"]["name"]
    return None


def variable_dtype(config: Mapping, dtype=None) -> str:
    """The dtype the backbone's variables will have.

    `dtype` (as passed to `from_preset`) wins over the config's own `dtype`;
    without either, Keras' `floatx()` applies. Mixed policies such as
    `"mixed_bfloat16"` keep float32 variables. Float dtypes and mixed
    policies are read without importing Keras.

    Raises:
        DTypeError: for anything that is not a dtype or dtype policy.

    Example:
    >>> variable_dtype({}, "mixed_bfloat16")
    'float32'
    """
    policy = dtype if dtype is not None else config.get("dtype")
    if policy is None:
        return floatx()
    name = _policy_name(policy)
    if name in _FLOAT_DTYPES:
        return name
    if name in ("mixed_float16", "mixed_bfloat16"):
        return "float32"
    source = "dtype" if dtype is not None else "the preset's config dtype"
    if not isinstance(policy, (str, Mapping)) and not hasattr(policy, "variable_dtype"):
        raise DTypeError(
            f"{source} must be a dtype name such as 'bfloat16', a policy "
            "name such as 'mixed_bfloat16', or a `keras.DTypePolicy`. "
            f"Received: dtype={policy!r} of type {type(policy).__name__}"
        )
    import keras

    try:
        if isinstance(policy, Mapping):
            policy = keras.dtype_policies.deserialize(dict(policy))
        if isinstance(policy, str):
            policy = keras.DTypePolicy(policy)
        return str(policy.variable_dtype)
    except (TypeError, ValueError, AttributeError) as error:
        raise DTypeError(
            f"{source} is not a dtype or dtype policy Keras knows ({error}). "
            "Use e.g. 'bfloat16', 'float32' or 'mixed_bfloat16'. Received: "
            f"dtype={policy!r}"
        ) from error


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


def is_quantized(config: Mapping) -> bool:
    """Whether a backbone config carries a quantized dtype policy map.

    Example:
    >>> is_quantized({"dtype": "float32"})
    False
    """
    dtype = config.get("dtype")
    if not isinstance(dtype, Mapping):
        return False
    policies = dtype.get("config", {}).get("policy_map", {})
    return any(
        "Quantized" in str(policy.get("class_name", ""))
        for policy in policies.values()
        if isinstance(policy, Mapping)
    )
