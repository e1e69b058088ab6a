"""Fixes of keras-hub bugs that users of the plugin meet (the package's
`__init__` registers these patches; `plugin.activate` installs them and
`plugin.deactivate` removes them, with `device_mesh=` or without).

- A tied Llama saved with `save_to_preset` can't be loaded back: keras-hub
  0.32's `LlamaBackbone.get_config` leaves out `tie_word_embeddings`.
  `get_config` then says it, so every save writes a config that keras-hub
  itself (any version, plugin or not) loads; and keras-hub's preset loader
  reads a config saved without it as its weights file says
  (`tied_embeddings.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from keras_hub_autodist.compat.tied_embeddings import SHARDED_WEIGHTS_INDEX
from keras_hub_autodist.compat.tied_embeddings import TYING_FIELD
from keras_hub_autodist.compat.tied_embeddings import WEIGHTS_FILE
from keras_hub_autodist.compat.tied_embeddings import lacks_tying
from keras_hub_autodist.compat.tied_embeddings import with_tying

_PRESET_UTILS = "keras_hub.src.utils.preset_utils"
_LLAMA = "keras_hub.models.LlamaBackbone"
_ACTIVE = "from `activate()` to `deactivate()`"

# The fields of `compat.Patch` (name, holder, attribute, owner, lasts).
PATCH_FIELDS = (
    (
        "llama_config_says_tying",
        _LLAMA,
        "get_config",
        "keras_hub_autodist.compat.upstream",
        _ACTIVE,
    ),
    (
        "preset_tying_from_weights",
        f"{_PRESET_UTILS}.KerasPresetLoader",
        "_load_serialized_object",
        "keras_hub_autodist.compat.upstream",
        _ACTIVE,
    ),
)

TOUCHPOINTS = (
    (_PRESET_UTILS, "get_file"),
    (_PRESET_UTILS, "check_file_exists"),
)


def config_says_tying(get_config):
    """`LlamaBackbone.get_config` with `tie_word_embeddings`."""

    @functools.wraps(get_config)
    def call(self):  # the original: `call.__wrapped__`
        config = get_config(self)
        if hasattr(self, TYING_FIELD):
            config.setdefault(TYING_FIELD, getattr(self, TYING_FIELD))
        return config

    return call


def _weights_file(preset) -> str | None:
    """The local path of a preset's weights file (or sharded index), fetched
    as keras-hub fetches it to load the weights; None when it has none."""
    from keras_hub.src.utils import preset_utils

    for name in (WEIGHTS_FILE, SHARDED_WEIGHTS_INDEX):
        try:
            if preset_utils.check_file_exists(preset, name):
                return preset_utils.get_file(preset, name)
        except Exception:  # noqa: BLE001 - keras-hub's own load reports it
            return None
    return None


def _with_tying(serialized: Mapping, preset) -> Mapping:
    """A serialized backbone (or task holding one) whose config leaves out
    tying, with tying as the preset's weights say; others unchanged."""
    if not isinstance(serialized, Mapping) or not isinstance(
        serialized.get("config"), Mapping
    ):
        return serialized
    config = serialized["config"]
    backbone = config.get("backbone")
    if isinstance(backbone, Mapping) and isinstance(backbone.get("config"), Mapping):
        fixed = _with_tying(backbone, preset)
        if fixed is backbone:
            return serialized
        return {**serialized, "config": {**config, "backbone": fixed}}
    if not lacks_tying(serialized, config):
        return serialized
    weights = _weights_file(preset)
    fixed = with_tying(serialized, config, weights)
    return {**serialized, "config": fixed}


def tying_from_weights(load_serialized_object):
    """keras-hub's `KerasPresetLoader._load_serialized_object`, reading a
    Llama config saved without `tie_word_embeddings` as its weights say."""

    @functools.wraps(load_serialized_object)
    def call(self, config, **kwargs):
        return load_serialized_object(self, _with_tying(config, self.preset), **kwargs)

    return call


# Patch name -> its replacement, a function of the original attribute.
REPLACEMENTS = {
    "llama_config_says_tying": config_says_tying,
    "preset_tying_from_weights": tying_from_weights,
}
_ATTRIBUTES = {name: attribute for name, _, attribute, _, _ in PATCH_FIELDS}
# Marks a replacement of `REPLACEMENTS`, whose original is its `__wrapped__`.
_FIX_ATTR = "__keras_hub_autodist_upstream_fix__"


def _holders() -> dict:
    """Patch name -> the class it changes."""
    import keras_hub
    from keras_hub.src.utils import preset_utils

    return {
        "llama_config_says_tying": keras_hub.models.LlamaBackbone,
        "preset_tying_from_weights": preset_utils.KerasPresetLoader,
    }


def fixes_to_install() -> dict:
    """Patch name -> its replacement, for each fix not in place yet
    (`plugin.activate` sets them with `compat.set_patch`)."""
    fixes = {}
    for name, holder in _holders().items():
        current = vars(holder)[_ATTRIBUTES[name]]
        if not getattr(current, _FIX_ATTR, False):
            fixed = REPLACEMENTS[name](current)
            setattr(fixed, _FIX_ATTR, True)
            fixes[name] = fixed
    return fixes


def originals_to_restore() -> dict:
    """Patch name -> keras-hub's original, for each fix in place
    (`plugin.deactivate` sets them back with `compat.set_patch`)."""
    return {
        name: current.__wrapped__
        for name, holder in _holders().items()
        if getattr(current := vars(holder)[_ATTRIBUTES[name]], _FIX_ATTR, False)
    }
