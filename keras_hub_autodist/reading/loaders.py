"""keras-hub's loader of a preset whose config needs keras-hub.

`hf://` and `kaggle://` handles, built-in names, and configs keras-hub has
not converted before are read through keras-hub's own preset loaders
(reached through `compat`), so that planning sees exactly the config
`from_preset` will build from. `open_loader` opens one for a
`ConfigSource` and names what went wrong in the words of the preset: no
network, no `config.json`, no such folder, a model type keras-hub can't
convert. A Kaggle preset cached by kagglehub is found here too, for loading
it offline.
"""

from __future__ import annotations

import json
import os
import re

from keras_hub_autodist import compat
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import PresetError
from keras_hub_autodist.errors import UnsupportedArchitectureError
from keras_hub_autodist.reading.network import check_hugging_face_reachable
from keras_hub_autodist.reading.records import CONFIG_FILE
from keras_hub_autodist.reading.records import ConfigSource
from keras_hub_autodist.reading.records import neither_format_error


def open_loader(source: ConfigSource):
    """keras-hub's loader of `source`: its preset loader for a preset
    string, the loader of its format for a config dict.

    Raises:
        PresetError: the network is unreachable, the preset has no
            `config.json` or names no folder, handle or built-in preset.
        UnsupportedArchitectureError: a Hugging Face `model_type` keras-hub
            can't convert, or a `config.json` of neither format.
        ConfigError: a `config.json` that is no JSON object.

    Example:
    ```python
    open_loader(read_source("hf://google/gemma-2b")).config["model_type"]
    ```
    """
    if source.preset.lower().startswith("kaggle://"):
        check_kaggle_handle(source.preset)
    try:
        return _loader(source)
    except Exception as error:
        named = _named_error(error, source)
        if named is None:
            raise
        raise named from error


def _loader(source: ConfigSource):
    if not source.dict_kind:
        check_hugging_face_reachable(source.preset)  # fails fast: no 35 s of retries
        return compat.preset_loader(source.preset)
    if "registered_name" in source.raw:
        return compat.keras_preset_loader(source.preset, dict(source.raw))
    return compat.transformers_preset_loader(source.preset, dict(source.raw))


def _named_error(error: Exception, source: ConfigSource) -> Exception | None:
    """`error`, raised while opening keras-hub's loader, in the words of the
    preset; `None` for an error keras-hub's own message names well."""
    preset = source.preset
    if source.dict_kind:
        if isinstance(error, ValueError) and "registered_name" not in source.raw:
            return _unconvertible(preset, repr(source.raw["model_type"]))
        return None
    if is_network_error(error):
        return PresetError(
            f"Can't download `{CONFIG_FILE}` of the preset: the network "
            "is unreachable. Connect, or pass a local folder holding the "
            f"preset's `{CONFIG_FILE}` (e.g. saved with `save_to_preset`, "
            "or a Hugging Face checkpoint folder). Received: "
            f"preset={preset!r} ({type(error).__name__})"
        )
    if isinstance(error, FileNotFoundError):
        return PresetError(
            f"The preset has no `{CONFIG_FILE}`, which planning needs. "
            "Point to a folder (or handle) holding a Keras preset saved "
            "with `save_to_preset` or a Hugging Face checkpoint with its "
            f"`{CONFIG_FILE}`. Received: preset={preset!r} ({error})"
        )
    if isinstance(error, ValueError) and (
        "no config.json" in str(error) or "Unknown preset" in str(error)
    ):
        if not os.path.exists(os.path.expanduser(preset)):
            return _no_such_folder(preset)
        return PresetError(
            f"Can't read `{CONFIG_FILE}` from the preset. Pass a folder "
            f"that contains `{CONFIG_FILE}`, an `hf://` or `kaggle://` "
            "handle, or a built-in preset name. Received: "
            f"preset={preset!r}"
        )
    if isinstance(error, ValueError) and "has no converter" in str(error):
        found = re.search(r"model type `(.+?)`", str(error))
        return _unconvertible(preset, found.group(1) if found else "(unknown)")
    if isinstance(error, ValueError) and "Unrecognized format" in str(error):
        return neither_format_error(preset)
    if isinstance(error, json.JSONDecodeError):
        return PresetError(
            f"The preset's `{CONFIG_FILE}` is not valid JSON ({error}). "
            f"Fix or replace the file. Received: preset={preset!r}"
        )
    if isinstance(error, TypeError):
        # keras-hub looks keys up in the config before anything else: a
        # `config.json` holding null, a list or a number fails there.
        return ConfigError(
            f"The preset's `{CONFIG_FILE}` is not a JSON object of the "
            f"backbone's configuration ({error}). Save the model again "
            "with `save_to_preset`, or restore the file. Received: "
            f"preset={preset!r}"
        )
    return None


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
