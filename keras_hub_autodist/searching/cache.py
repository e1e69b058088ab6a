"""Target compiles kept on disk, so that a search asked again answers in
seconds: each compiled step (`compiled_step.CompiledMemory`) is a JSON file
under `~/.cache/keras_hub_autodist/compiles` (beside the abstract builds of
`reading.disk_cache`, and off when that cache is off), or under
`$KERAS_HUB_AUTODIST_COMPILE_CACHE`, or the folder a search is given.

An entry's name is the digest of all that decides the compiled program:
every input of the step, gathered in one place
(`step_inputs.CompiledStepInputs`: the model's config, the whole layout
plan with its dtype and mixed-precision policy, remat, LoRA rank and mesh,
the step's batch, sequence and optimizer, the target, and what the build
reads from the process: Keras' global dtype policy, compiler flags, the
attention and loss-chunk rules), the versions of every compiler and
library on the way (`VERSIONED`), and a digest of this package's own code
(`code_digest`), which builds the step: a changed step is a new key even
where the version string stays. A different key is a different file; a
file that is unreadable, or whose entry is not one `store_compile` writes,
is a miss: compiled again and rewritten. A folder that can't hold entries
(a file, no permission) means no cache, with one warning
(`usable_cache_folder`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import secrets
from importlib import metadata
from typing import TYPE_CHECKING

from keras_hub_autodist.environment import read_folder_switch
from keras_hub_autodist.errors import warn
from keras_hub_autodist.fitting.compiled_analysis import Collective
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.reading.disk_cache import cache_folder
from keras_hub_autodist.reading.disk_cache import package_cache_root
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

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
    """Where compiled steps are kept: `folder`; else as
    `$KERAS_HUB_AUTODIST_COMPILE_CACHE` says, read as the package reads its
    other switches (`environment.read_folder_switch`): an off value (`0`,
    `off`...) turns it off, an on value (`1`, `on`...) keeps the default
    folder, anything else names the folder; unset, `compiles` beside the
    package's disk cache (`reading.disk_cache.cache_folder`), none when
    that is off.

    Example:
    >>> compile_cache_folder("/tmp/c").name
    'c'
    """
    if folder is not None:
        return pathlib.Path(folder).expanduser()
    setting, named = read_folder_switch(COMPILE_CACHE_ENV)
    if setting is False:
        return None
    if named:
        return pathlib.Path(named).expanduser()
    base = cache_folder()
    if base is None:
        # The disk cache is off: the compile cache too, unless turned on.
        return package_cache_root() / "compiles" if setting else None
    return (base.parent if base.name == "abstract" else base) / "compiles"


def usable_cache_folder(folder: pathlib.Path | None) -> pathlib.Path | None:
    """`folder`, created if absent, when it can hold entries; else `None`,
    with one warning that says why and how to point the cache elsewhere.

    Example:
    >>> usable_cache_folder(None) is None
    True
    """
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"no permission to write in {folder}")
    except OSError as error:
        reason = "it is a file" if folder.is_file() else str(error)
        warn(
            f"The compile cache folder {folder} can't hold compiled steps "
            f"({reason}): this search compiles without a cache. Set "
            f"{COMPILE_CACHE_ENV} (or cache_dir=) to a folder, or to 0 to turn "
            f"the cache off. Received: {folder}"
        )
        return None
    return folder


# The package's files that build or compile a step: its Python code and the
# GPU target configs it ships.
_CODE_SUFFIXES = (".py", ".txtpb")


@functools.cache
def code_digest() -> str:
    """A digest of this package's own code (every `.py` file and GPU target
    config), computed once per process: a compile cached by other code is
    not served, whatever the version string says."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    files = sorted(
        path
        for path in root.rglob("*")
        if path.suffix in _CODE_SUFFIXES and "__pycache__" not in path.parts
    )
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def versions() -> dict[str, str]:
    """The installed version of each of `VERSIONED` (`""` when absent)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def step_key(inputs: CompiledStepInputs) -> str:
    """The digest naming a compiled step: every input of it
    (`CompiledStepInputs.key_fields`), the versions of the libraries and
    compilers on the way, and this package's code."""
    key = {
        "format": ENTRY_FORMAT,
        "inputs": inputs.key_fields(),
        "versions": versions(),
        "code": code_digest(),
    }
    text = json.dumps(key, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def compile_key(
    plan: PlanRecord,
    config: dict,
    batch_size: int,
    sequence_length: int,
    optimizer: str,
    device: str,
    lora_rank: int | None = None,
) -> str:
    """`step_key` of the step these inputs make, in this process's
    environment (`step_inputs.step_environment`)."""
    return step_key(
        CompiledStepInputs(
            plan, config, batch_size, sequence_length, optimizer, device, lora_rank
        )
    )


def memory_to_json(memory: CompiledMemory) -> dict:
    """A `CompiledMemory` as plain JSON."""
    value = dataclasses.asdict(memory)
    value["collectives"] = [dataclasses.asdict(c) for c in memory.collectives]
    return value


def memory_from_json(value: dict) -> CompiledMemory:
    """The `CompiledMemory` `memory_to_json` wrote.

    Raises:
        ValueError: for a value `memory_to_json` doesn't write (a field
            missing, unknown or of another type).
    """
    if not isinstance(value, dict):
        raise ValueError(f"not an object: {type(value).__name__}")
    fields = dict(value)
    collectives = fields.get("collectives")
    if not isinstance(collectives, list) or not all(
        isinstance(c, dict) and _typed(Collective, c) for c in collectives
    ):
        raise ValueError("collectives are not a list of collectives")
    fields["collectives"] = tuple(Collective(**c) for c in collectives)
    if not _typed(CompiledMemory, fields):
        raise ValueError("a field is missing, unknown or of another type")
    if not all(
        isinstance(v, (int, float)) and not isinstance(v, bool)
        for v in fields.get("cost", {}).values()
    ):
        raise ValueError("a cost is not a number")
    return CompiledMemory(**fields)


# The JSON types each annotation of a stored dataclass takes (`bool` is not
# an `int` here: `True` is no byte count).
_JSON_TYPES = {
    "int": (int,),
    "int | None": (int, type(None)),
    "float": (int, float),
    "str": (str,),
    "dict": (dict,),
    "tuple": (tuple,),
}


def _typed(cls, fields: dict) -> bool:
    """Whether `fields` are exactly `cls`'s required fields and some of its
    optional ones, each of its annotated type."""
    declared = {f.name: f for f in dataclasses.fields(cls)}
    required = {
        name
        for name, f in declared.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if not required <= set(fields) <= set(declared):
        return False
    for name, value in fields.items():
        types = _JSON_TYPES.get(str(declared[name].type), (object,))
        if isinstance(value, bool) or not isinstance(value, types):
            return False
    return True


def read_compile(folder: pathlib.Path | None, key: str) -> CompiledMemory | None:
    """The compiled step stored under `key`, or `None`: absent, unreadable,
    or not an entry `store_compile` writes for `key` (a miss, so that it is
    compiled again and rewritten)."""
    if folder is None:
        return None
    try:
        entry = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        if not isinstance(entry, dict):
            return None
        if entry.get("format") != ENTRY_FORMAT or entry.get("key") != key:
            return None
        return memory_from_json(entry.get("memory"))
    except (OSError, ValueError, TypeError):
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
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass  # the folder can't hold files at all: nothing was written


__all__ = [
    "COMPILE_CACHE_ENV",
    "code_digest",
    "compile_cache_folder",
    "compile_key",
    "memory_from_json",
    "memory_to_json",
    "read_compile",
    "step_key",
    "store_compile",
    "usable_cache_folder",
    "versions",
]
