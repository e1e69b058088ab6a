"""Which entries of a folder are files of keras-hub's preset format.

A save replaces exactly these (`atomic.py`): whatever the new preset writes,
and every file of the format that a loader of the new preset could read,
even when the new save does not write it. Those are, at the top of the
folder (keras-hub's `keras_hub/src/utils/preset_utils.py`):

- the configs: `config.json`, `metadata.json`, `task.json`,
  `preprocessor.json`, `tokenizer.json`, `audio_converter.json`,
  `image_converter.json`, `video_converter.json`;
- the weights: `model.weights.h5`, `task.weights.h5`, the index of sharded
  weights `model.weights.json`, its shards as Keras names them
  (`model_00000.weights.h5`, ...) and every `.h5` file that index lists.

Anything else survives a save, as with keras-hub's own save: the user's
`README.md`, `notes.json`, `my_lora.weights.h5`, `assets/mine/`, a Hugging
Face checkpoint's files, and, below `assets/`, every file the new preset does
not write. The files a tokenizer or preprocessor keeps below
`assets/<layer>/` are read by name (the ones its save writes), so an old one
the new save doesn't write is never loaded.

tests/test_saving.py checks these names against keras-hub's constants
(`compat.preset_format_names`).

Example:
>>> is_format_name("task.json"), is_format_name("notes.json")
(True, False)
"""

from __future__ import annotations

import json
import os
import re

from keras_hub_autodist.reading.records import CONFIG_FILE

SHARDED_INDEX_FILE = "model.weights.json"
ASSETS_FOLDER = "assets"
# The files of the format at the top of a preset folder.
FORMAT_FILES = frozenset(
    {
        CONFIG_FILE,
        "metadata.json",
        "task.json",
        "preprocessor.json",
        "tokenizer.json",
        "audio_converter.json",
        "image_converter.json",
        "video_converter.json",
        "model.weights.h5",
        "task.weights.h5",
        SHARDED_INDEX_FILE,
    }
)
# Keras' names for the shards of `model.weights.json` (`ShardedH5IOStore`).
SHARD_NAME = re.compile(r"model_[0-9]{5,}\.weights\.h5")


def is_format_name(name: str) -> bool:
    """Whether `name`, at the top of a folder, is a file of the format by its
    name alone (the shards an index lists are found by `format_entries`).

    Example:
    >>> is_format_name("model_00003.weights.h5"), is_format_name("my.weights.h5")
    (True, False)
    """
    return name in FORMAT_FILES or SHARD_NAME.fullmatch(name) is not None


def listed_shards(folder: str) -> set[str]:
    """The shard files `folder/model.weights.json` lists: plain `.h5` names
    inside `folder` only (an index that is missing or unreadable lists none).

    Example:
    >>> listed_shards("/nonexistent")
    set()
    """
    try:
        with open(os.path.join(folder, SHARDED_INDEX_FILE), encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        values = list(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    names = set()
    for value in values:
        for name in value if isinstance(value, list) else [value]:
            if _plain_h5_name(name):
                names.add(name)
    return names


def _plain_h5_name(name) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".h5")
        and not name.startswith(".")
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
    )


def format_entries(folder: str) -> set[str]:
    """The names at the top of `folder` that are files of the preset format.

    Args:
        folder: an existing folder (an old preset, or any folder a save
            targets).

    Returns:
        The names present in `folder` that `is_format_name`, plus the shards
        its `model.weights.json` lists.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    shards = listed_shards(folder)
    return {name for name in names if is_format_name(name) or name in shards}
