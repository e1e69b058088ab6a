"""Read a preset's backbone class and config without building the model.

This is the only module that imports `keras_hub.src`: it uses keras-hub's own
preset loaders (local folders, `hf://`, `kaggle://`, built-in names) and its
Hugging Face → Keras config converters, so that planning sees exactly the
config `from_preset` will build from. Only `config.json` is read.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import keras

from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError

CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class PresetConfig:
    """What planning needs to know about a preset.

    Args:
        preset: the preset as given (path or handle).
        backbone_cls: the keras-hub backbone class `from_preset` will build.
        config: the backbone's constructor arguments.
        format: `"keras"` or `"transformers"`.
    """

    preset: str
    backbone_cls: type
    config: Mapping
    format: str


def _loader_for(preset):
    from keras_hub.src.utils import preset_utils

    if not isinstance(preset, str):
        raise PresetError(
            "A preset is a string: a local folder, `hf://owner/name`, "
            "`kaggle://owner/model/keras/variation[/version]` or a built-in "
            f"preset name. Received: preset={preset!r} of type "
            f"{type(preset).__name__}"
        )
    try:
        return preset_utils.get_preset_loader(preset)
    except FileNotFoundError as error:
        raise PresetError(
            f"The preset has no `{CONFIG_FILE}`, which planning needs. Point "
            "to a folder (or handle) holding a Keras preset saved with "
            "`save_to_preset` or a Hugging Face checkpoint with its "
            f"`{CONFIG_FILE}`. Received: preset={preset!r} ({error})"
        ) from error
    except ValueError as error:
        if "no config.json" in str(error) or "Unknown preset" in str(error):
            raise PresetError(
                f"Can't read `{CONFIG_FILE}` from the preset. Pass a folder "
                f"that contains `{CONFIG_FILE}`, an `hf://` or `kaggle://` "
                "handle, or a built-in preset name. Received: "
                f"preset={preset!r}"
            ) from error
        raise


def read_preset_config(preset: str) -> PresetConfig:
    """Read the backbone class and config of `preset` from its config.json.

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
    raw = loader.config
    if "registered_name" in raw:
        backbone_cls = loader.check_backbone_class()
        return PresetConfig(preset, backbone_cls, dict(raw["config"]), "keras")
    if "model_type" in raw:
        if raw.get("vision_config") is not None:
            raise UnsupportedArchitectureError(
                "keras_hub_autodist plans text-only models; this Hugging Face "
                f"checkpoint (model_type={raw['model_type']!r}) has a vision "
                "tower. Use its text-only variant or your own layout map. "
                f"Received: preset={preset!r}"
            )
        converter = loader.converter
        backbone_cls = loader.check_backbone_class()
        convert = converter.convert_backbone_config
        if len(inspect.signature(convert).parameters) != 1:
            config = convert(raw, backbone_cls)
        else:
            config = convert(raw)
        return PresetConfig(preset, backbone_cls, dict(config), "transformers")
    raise UnsupportedArchitectureError(
        f"The preset's `{CONFIG_FILE}` is neither a Keras preset config nor a "
        "Hugging Face transformers config. Save the model with "
        "`save_to_preset`, or pass a transformers checkpoint folder. "
        f"Received: preset={preset!r}"
    )


def variable_dtype(config: Mapping, dtype=None) -> str:
    """The dtype the backbone's variables will have.

    `dtype` (as passed to `from_preset`) wins over the config's own `dtype`;
    without either, Keras' `floatx()` applies. Mixed policies such as
    `"mixed_bfloat16"` keep float32 variables.

    Example:
    >>> variable_dtype({}, "mixed_bfloat16")
    'float32'
    """
    policy = dtype if dtype is not None else config.get("dtype")
    if policy is None:
        return keras.config.floatx()
    if isinstance(policy, Mapping):
        policy = keras.dtype_policies.deserialize(dict(policy))
    if isinstance(policy, str):
        policy = keras.DTypePolicy(policy)
    return policy.variable_dtype


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
    handle_text = preset.split("://", 1)[1]
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
    """True for connection errors raised by requests/urllib3 or the OS."""
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
