"""Whether a preset's token embedding is tied, read from its weights file.

keras-hub 0.32's `LlamaBackbone.get_config` (and so `Llama3Backbone`'s)
leaves out `tie_word_embeddings`: a tied Llama (Llama 3.2 1B and 3B are
tied) saved with `save_to_preset` has a `config.json` that reads as untied,
and its weights can't be loaded into the untied model it builds. The
weights file says which it is: a tied `ReversibleEmbedding` saves one
variable (the embeddings), an untied one two (and the reverse embeddings).
Nothing here imports Keras or keras-hub; `h5py` reads the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

# Registered names of the backbones whose saved config leaves out tying.
CONFIGS_WITHOUT_TYING = ("keras_hub>LlamaBackbone", "keras_hub>Llama3Backbone")
TYING_FIELD = "tie_word_embeddings"
# keras-hub's weights files of a preset: one file, or a sharded file's index.
WEIGHTS_FILE = "model.weights.h5"
SHARDED_WEIGHTS_INDEX = "model.weights.json"
# The token embedding's variables in Keras' weights file (a backbone's one
# `ReversibleEmbedding`): "0" the embeddings, "1" the reverse embeddings,
# which a tied embedding doesn't have.
EMBEDDING_VARIABLES = "layers/reversible_embedding/vars"
REVERSE_EMBEDDINGS = "1"


def lacks_tying(raw: Mapping, config: Mapping) -> bool:
    """Whether a `config.json` (`raw`, with the backbone's arguments
    `config`) is of a class whose saved config leaves out tying, and says
    nothing of it."""
    return raw.get("registered_name") in CONFIGS_WITHOUT_TYING and (
        TYING_FIELD not in config
    )


def _variable_names(h5_path: str) -> set[str] | None:
    import h5py

    try:
        with h5py.File(h5_path, "r") as file:
            group = file.get(EMBEDDING_VARIABLES)
            return None if group is None else set(group.keys())
    except OSError:
        return None  # no such file, or not HDF5: keras-hub's load reports it


def _shards_of(index_path: str) -> list[str]:
    try:
        with open(index_path, encoding="utf-8") as file:
            weight_map = json.load(file).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return []
    names = weight_map.get(f"/{EMBEDDING_VARIABLES}") or []
    names = [names] if isinstance(names, str) else names
    folder = os.path.dirname(index_path)
    return [os.path.join(folder, name) for name in names if isinstance(name, str)]


def weights_say_tied(weights_path: str) -> bool | None:
    """Whether the token embedding saved in a Keras weights file is tied.

    Args:
        weights_path: a `model.weights.h5`, or the `model.weights.json`
            index of a sharded one (its shards beside it).

    Returns:
        True when the embedding has no reverse embeddings, False when it has
        them, None when the file doesn't tell (missing, unreadable, no
        `ReversibleEmbedding`).

    Example:
    ```python
    weights_say_tied("./llama3.2_1b_tuned/model.weights.h5")  # True
    ```
    """
    if weights_path.endswith(".json"):
        paths = _shards_of(weights_path)
    else:
        paths = [weights_path]
    names: set[str] = set()
    for path in paths:
        found = _variable_names(path)
        if found is not None:
            names |= found
    if not names:
        return None
    return REVERSE_EMBEDDINGS not in names


def local_weights_file(folder: str) -> str | None:
    """The weights file (or sharded index) of a local preset folder."""
    for name in (WEIGHTS_FILE, SHARDED_WEIGHTS_INDEX):
        path = os.path.join(os.path.expanduser(folder), name)
        if os.path.isfile(path):
            return path
    return None


def with_tying(raw: Mapping, config: Mapping, weights_path: str | None) -> dict:
    """The backbone's arguments `config` of a `config.json` `raw`, with
    `tie_word_embeddings` as its weights say when the config leaves it out
    (`CONFIGS_WITHOUT_TYING`); unchanged otherwise. Neither is modified.

    Example:
    ```python
    with_tying(raw, raw["config"], "./tuned/model.weights.h5")
    # {..., "tie_word_embeddings": True}
    ```
    """
    config = dict(config)
    if weights_path is None or not lacks_tying(raw, config):
        return config
    tied = weights_say_tied(weights_path)
    if tied is not None:
        config[TYING_FIELD] = tied
    return config
