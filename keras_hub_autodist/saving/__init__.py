"""Saving a bound model: all-or-nothing `save_to_preset` (`atomic`), the
file-system pieces of a save (`folders`), which entries of a folder belong to
keras-hub's preset format (`preset_files`), and saves from several processes
(`gathering`, `weight_stores`).

`save_atomically` and `recover` are `atomic`'s, named here as well; they load
on first use (PEP 562).
"""

import importlib

_ATOMIC_NAMES = ("recover", "save_atomically")

__all__ = list(_ATOMIC_NAMES)


def __getattr__(name):
    if name not in _ATOMIC_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.atomic"), name)
