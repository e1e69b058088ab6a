"""Target compiles kept on disk, so that a search asked again answers in
seconds: each compiled step (`compiled_step.CompiledMemory`) is a JSON file
under `~/.cache/keras_hub_autodist/compiles` (beside the abstract builds of
`reading.disk_cache`, and off when that cache is off), or under
`$KERAS_HUB_AUTODIST_COMPILE_CACHE`, or the folder a search is given.

An entry's name is the digest of all that decides the compiled program:
the model's config, the layout (mesh, strategy, every weight's sharding,
remat, LoRA rank, dtype), the step (batch, sequence, optimizer), the target
and the versions of every compiler and library on the way (`VERSIONED`).
A different key is a different file; an unreadable file is compiled again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import secrets
from importlib import metadata
from typing import TYPE_CHECKING

from keras_hub_autodist.environment import is_off
from keras_hub_autodist.fitting.compiled_analysis import Collective
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.reading.disk_cache import cache_folder

if TYPE_CHECKING:
    from keras_hub_autodist.planning.plan_record import PlanRecord

COMPILE_CACHE_ENV = "KERAS_HUB_AUTODIST_COMPILE_CACHE"
# The distributions whose versions change a compiled program.
VERSIONED = (
    "jax",
    "jaxlib",
    "libtpu",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "keras",
    "keras-hub",
    "keras-hub-autodist",
)
# The layout of an entry; one of another format is compiled again.
ENTRY_FORMAT = 1


def compile_cache_folder(
    folder: str | os.PathLike | None = None,
) -> pathlib.Path | None:
    """Where compiled steps are kept: `folder`; else
    `$KERAS_HUB_AUTODIST_COMPILE_CACHE` (an off value such as `0` turns it
    off); else `compiles` beside the package's disk cache
    (`reading.disk_cache.cache_folder`), none when that is off.

    Example:
    >>> compile_cache_folder("/tmp/c").name
    'c'
    """
    if folder is not None:
        return pathlib.Path(folder).expanduser()
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if value:
        return None if is_off(value) else pathlib.Path(value).expanduser()
    base = cache_folder()
    if base is None:
        return None
    return (base.parent if base.name == "abstract" else base) / "compiles"


def versions() -> dict[str, str]:
    """The installed version of each of `VERSIONED` (`""` when absent)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def compile_key(
    plan: PlanRecord,
    config: dict,
    batch_size: int,
    sequence_length: int,
    optimizer: str,
    device: str,
) -> str:
    """The digest naming a compiled step: config, layout, step, target and
    versions (see the module's docstring)."""
    layout = {
        "backbone": plan.backbone_class,
        "mesh": [list(plan.mesh_axes.axis_names), list(plan.mesh_axes.shape)],
        "strategy": plan.strategy,
        "remat": plan.remat,
        "lora_rank": plan.lora_rank,
        "dtype": plan.dtype,
        "specs": [[row.path, list(map(str, row.spec))] for row in plan.rows],
    }
    key = {
        "format": ENTRY_FORMAT,
        "config": config,
        "layout": layout,
        "step": [batch_size, sequence_length, optimizer],
        "device": device,
        "versions": versions(),
    }
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def memory_to_json(memory: CompiledMemory) -> dict:
    """A `CompiledMemory` as plain JSON."""
    value = dataclasses.asdict(memory)
    value["collectives"] = [dataclasses.asdict(c) for c in memory.collectives]
    return value


def memory_from_json(value: dict) -> CompiledMemory:
    """The `CompiledMemory` `memory_to_json` wrote."""
    fields = dict(value)
    fields["collectives"] = tuple(Collective(**c) for c in fields["collectives"])
    return CompiledMemory(**fields)


def read_compile(folder: pathlib.Path | None, key: str) -> CompiledMemory | None:
    """The compiled step stored under `key`, or `None`."""
    if folder is None:
        return None
    try:
        entry = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        if entry.get("format") != ENTRY_FORMAT or entry.get("key") != key:
            return None
        return memory_from_json(entry["memory"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_compile(
    folder: pathlib.Path | None, key: str, memory: CompiledMemory
) -> None:
    """Keep a compiled step under `key` (atomically; silently skipped where
    the folder is not writable)."""
    if folder is None:
        return
    payload = json.dumps(
        {"format": ENTRY_FORMAT, "key": key, "memory": memory_to_json(memory)},
        sort_keys=True,
    )
    path = folder / f"{key}.json"
    partial = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        partial.write_text(payload, encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)


__all__ = [
    "COMPILE_CACHE_ENV",
    "compile_cache_folder",
    "compile_key",
    "memory_from_json",
    "memory_to_json",
    "read_compile",
    "store_compile",
    "versions",
]
