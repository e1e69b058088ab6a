"""Replace a preset folder so that readers never see old and new mixed, and
nothing a save did not write is lost.

Which files a save replaces (`preset_files.py`): every file the new preset
writes, and every file of keras-hub's preset format at the top of the folder
(`config.json`, `task.json`, `tokenizer.json`, ..., `model.weights.h5`,
`task.weights.h5`, `model.weights.json` and its shards), whether or not the
new save writes it, so no file a loader of the new preset reads comes from an
older save. Every other entry of the folder survives, as with keras-hub's own
save: the user's `README.md`, `notes.json`, `my_lora.weights.h5`, `.git`,
`assets/mine/`, and every file below `assets/` the new preset doesn't write.

`save_atomically(save, preset_dir)` runs `save` into a staging folder beside
`preset_dir`, then swaps the complete new folder in by renames:

1. `save(".NAME.saving-XXXX")` writes the new preset (the folder holds an
   `.autodist-new` marker: a new preset, never the user's folder), then the
   folder gets the mode of the one it replaces, everything in it is flushed
   to disk (`fsync`) and it is renamed `.NAME.ready-XXXX`: it is complete.
2. The ready folder and `NAME` are exchanged in one step with Linux's
   `renameat2(RENAME_EXCHANGE)`. Where that call is missing, `NAME` is renamed
   to `.NAME.old-XXXX`, then the ready folder to `NAME`; between these two
   renames (microseconds) `NAME` does not exist, and a reader sees a missing
   preset, never a mix.
3. The entries of the old folder that are not files of the format, and that
   the new preset did not write, are moved into the new folder (folders such
   as `assets/` are merged entry by entry); then the old folder, which holds
   only replaced files, is deleted, and the marker removed. An entry that
   can't be moved keeps the old folder (with a warning naming it).

Every save first calls `recover(preset_dir)`, which resolves what a killed save
left behind: when `NAME` is missing, a `.NAME.ready-*` folder holding the
marker (a complete new preset) or else an old folder (`.NAME.old-*`, or a
`.NAME.ready-*` folder without the marker: the old one after the exchange) is
renamed back to `NAME`; then the user's entries of old folders are moved into
`NAME` as in step 3, and leftover staging folders and new presets never
swapped in are deleted. A complete copy is never deleted while `NAME` is
missing. Folders of saves still running are left alone: each save holds an
`flock` on its folders, and only unlocked leftovers are touched.

The new folder gets the mode keras-hub's `os.makedirs` would give it
(`0o777 & ~umask`), or the mode (and owner) of the folder it replaces, which
keras-hub keeps too. A folder this user owns but may not write (`0o555`) is
saved into as keras-hub does, which overwrites its files: it is made
writable for the user while its entries move, and keeps its mode.

When a folder can't be created beside `NAME` (a read-only parent folder),
`NAME` is a mount point, or `NAME` holds the working directory, the preset is
written in place, as keras-hub does, with a `UserWarning`: the new files are
staged in `NAME/.autodist-saving-XXXX`, then `config.json` is removed first,
the old files of the format the new preset doesn't write are removed, the
new files are moved in (merged into existing folders) and `config.json` is
put back last. A reader then sees the old preset, the new one, or, if a kill
hits while the files are moved, a folder without `config.json` that no loader
accepts, until the next save (or `recover`) completes the move.

Refused with `SaveTargetError`: an empty path (`""`), a path that is no
local folder path (`hf://...`, not a string), a file; with
`SavePermissionError` (a `PermissionError` too), a folder that can't be
created or replaced by this user. A bound model saved into the preset it was
loaded from is saved correctly: its weights were read whole during the load,
and nothing reads the old files afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import json
import os
import re
from collections.abc import Callable
from typing import Any

from keras_hub_autodist.errors import SavePermissionError
from keras_hub_autodist.errors import SaveTargetError
from keras_hub_autodist.errors import warn
from keras_hub_autodist.saving.folders import OURS
from keras_hub_autodist.saving.folders import entries
from keras_hub_autodist.saving.folders import flock
from keras_hub_autodist.saving.folders import is_folder
from keras_hub_autodist.saving.folders import list_names
from keras_hub_autodist.saving.folders import new_folder
from keras_hub_autodist.saving.folders import remove_entry
from keras_hub_autodist.saving.folders import remove_tree
from keras_hub_autodist.saving.folders import renamed
from keras_hub_autodist.saving.folders import sync_dir
from keras_hub_autodist.saving.folders import sync_tree
from keras_hub_autodist.saving.folders import unlocked
from keras_hub_autodist.saving.folders import walk_tree
from keras_hub_autodist.saving.folders import writable_while
from keras_hub_autodist.saving.preset_files import CONFIG_FILE
from keras_hub_autodist.saving.preset_files import format_entries

# Inside a folder written in place: the staged files, and the marker saying
# that a move of the staged files into the folder is under way.
_INSIDE_STAGING = ".autodist-saving-"
_INSIDE_READY = ".autodist-ready-"
_APPLYING = ".autodist-applying"
# In a staging folder beside the target: "this folder is a new preset".
_NEW_MARKER = ".autodist-new"
# The staging folders of the saves running in this thread or task.
_STAGING = contextvars.ContextVar("keras_hub_autodist_staging", default=())
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def save_atomically(
    save: Callable[..., Any], preset_dir: str | os.PathLike, *args, **kwargs
) -> Any:
    """Run `save(folder, *args, **kwargs)`, then swap the folder in as `preset_dir`.

    A reader of `preset_dir` sees the complete old preset or the complete new
    one, whenever the process dies. An error while saving leaves `preset_dir`
    as it was. The files of the preset format are replaced; every other
    entry of `preset_dir` is kept. The module docstring describes the steps,
    what a killed save leaves behind and how the next save resolves it, and
    the in-place mode used under a read-only parent folder.

    Args:
        save: writes a preset into the folder it receives first, e.g. the
            unbound `save_to_preset` method of a keras-hub model.
        preset_dir: the folder the preset ends up in; created if missing.
        *args: passed to `save` after the folder.
        **kwargs: passed to `save`.

    Returns:
        What `save` returned.

    Raises:
        SaveTargetError: `preset_dir` is empty, no local path, or a file.
        SavePermissionError: this user can't create or replace `preset_dir`.

    Example:
    ```python
    save_atomically(model.save_to_preset, "./tuned", max_shard_size=2)
    ```
    """
    target = os.path.realpath(_local_path(preset_dir))
    if any(os.path.commonpath([target, s]) == s for s in _STAGING.get()):
        # A save inside a save (a Task saves its bound backbone into the
        # folder it writes): the outer save swaps the whole folder in.
        return save(preset_dir, *args, **kwargs)
    parent, name = os.path.split(target)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise SaveTargetError(
            f"A preset is saved into a folder, and {target!r} is not a folder. "
            "Pass a new or existing folder path, or remove the file. "
            f"Received: preset_dir={os.fspath(preset_dir)!r}"
        )
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
        raise _cannot_create(target, parent, error, preset_dir) from error
    recover(target)
    reason = _in_place_reason(target)
    if reason is None:
        try:
            staging, lock = new_folder(parent, f".{name}.saving-")
        except OSError as error:
            if not os.path.isdir(target) or error.errno not in (
                errno.EACCES,
                errno.EPERM,
            ):
                raise _cannot_create(target, parent, error, preset_dir) from error
            reason = f"the parent folder {parent!r} is not writable"
        else:
            _check_replaceable(target, staging, lock, preset_dir)
    with contextlib.ExitStack() as stack:
        if reason is not None:
            warn(
                f"Saving into {target!r} in place, as keras-hub does, because "
                f"{reason}. If the process dies while the files are moved in, "
                f"the folder has no {CONFIG_FILE} (no loader accepts it) until "
                "the next save into it completes the move; old and new files "
                "are never mixed in a folder that has one.",
            )
            stack.enter_context(writable_while(target))
            try:
                staging, lock = new_folder(target, _INSIDE_STAGING)
            except OSError as error:
                raise _cannot_create(target, target, error, preset_dir) from error
        return _save_staged(save, staging, lock, target, reason, args, kwargs)


def _save_staged(save, staging, lock, target, reason, args, kwargs):
    """Run `save` into `staging` (locked by `lock`), then put it at `target`:
    swapped in whole, or moved in place when `reason` says why not."""
    try:
        if reason is None:
            _touch(os.path.join(staging, _NEW_MARKER))
        token = _STAGING.set((*_STAGING.get(), staging))
        try:
            result = save(staging, *args, **kwargs)
        finally:
            _STAGING.reset(token)
        if reason is None:
            _adopt_mode(staging, target)
        sync_tree(staging)
        ready = renamed(staging, "saving-", "ready-")
        os.rename(staging, ready)
        staging = ready
        if reason is None:
            _swap(ready, target)
        else:
            _apply_in_place(ready, target, _in_place_plan(ready, target))
        return result
    finally:
        with contextlib.suppress(FileNotFoundError):
            ours = os.path.samestat(os.fstat(lock), os.stat(staging))
            if ours and (_marker(target) or {}).get("ready") != os.path.basename(
                staging
            ):
                # Not swapped in: `preset_dir` is as it was. A move in place
                # that failed half-way is left for `recover` to finish.
                remove_tree(staging)
        os.close(lock)


def _local_path(preset_dir) -> str:
    """`preset_dir` as a local path string, or `SaveTargetError`."""
    if not isinstance(preset_dir, (str, bytes, os.PathLike)):
        raise SaveTargetError(
            "`preset_dir` is the path of a local folder (a string or a path "
            f"object). Received: preset_dir={preset_dir!r} of type "
            f"{type(preset_dir).__name__}"
        )
    path = os.fspath(preset_dir)
    path = os.fsdecode(path) if isinstance(path, bytes) else path
    if not path:
        raise SaveTargetError(
            "`preset_dir` is empty. Pass the folder to save the preset into, "
            "e.g. './my_preset' ('.' for the working folder). Received: "
            "preset_dir=''"
        )
    if _URL.match(path):
        raise SaveTargetError(
            "`save_to_preset` writes a local folder, and this path is a URL. "
            "Save into a local folder, then upload it (e.g. with "
            "`keras_hub.upload_preset`). Received: "
            f"preset_dir={path!r}"
        )
    return path


def _cannot_create(target, where, error, preset_dir) -> SaveTargetError:
    """The error of a save that can't create files in `where`."""
    kind = (
        SavePermissionError
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        else SaveTargetError
    )
    return kind(
        f"Can't save the preset into {target!r}: no file or folder can be "
        f"created in {where!r} ({os.strerror(error.errno or 0)}). Save into a "
        "folder this user may write to, or make it writable. Received: "
        f"preset_dir={os.fspath(preset_dir)!r}"
    )


def _check_replaceable(target, staging, lock, preset_dir):
    """Refuse, before anything is written, an existing `target` whose entries
    this user can neither move nor make movable (not writable, not owned)."""
    if not os.path.isdir(target) or os.access(target, os.W_OK | os.X_OK):
        return
    status = os.stat(target)
    if status.st_uid == os.geteuid():
        return  # made writable while its entries move (`writable_while`)
    remove_tree(staging)
    os.close(lock)
    raise SavePermissionError(
        f"Can't save the preset into {target!r}: this user may not change "
        f"that folder (mode {oct(status.st_mode & 0o7777)}, owned by user "
        f"{status.st_uid}), so its files can't be replaced. Make it writable "
        "for this user, or save into another folder. Received: "
        f"preset_dir={os.fspath(preset_dir)!r}"
    )


def recover(preset_dir: str | os.PathLike) -> None:
    """Resolve what saves into `preset_dir` that were killed left behind.

    Called by every save before it writes. When `preset_dir` is missing, the
    newest complete copy beside it (a ready new preset, else the old one moved
    aside) is renamed back to `preset_dir`; a move in place that was cut short
    is completed. Then the user's entries of old folders are moved into
    `preset_dir` and the leftover folders of dead saves are deleted. Folders
    that a running save holds are not touched.

    Args:
        preset_dir: the folder a save targets.

    Example:
    ```python
    recover("./tuned")  # after a kill, before reading ./tuned
    ```
    """
    target = os.path.realpath(os.fspath(preset_dir))
    parent, name = os.path.split(target)
    with contextlib.ExitStack() as held:
        if os.path.isdir(target) and not _finish_in_place(target, held):
            return  # a running save is moving its files in
        beside = entries(parent, f".{name}.")
        ready = unlocked(beside, f".{name}.ready-", held)
        new = [folder for folder in ready if _is_new(folder)]
        old = [folder for folder in ready if folder not in new]
        old += unlocked(beside, f".{name}.old-", held)
        if not os.path.lexists(target):
            for candidates in (new, old):
                if candidates:
                    newest = max(candidates, key=lambda p: os.stat(p).st_mtime_ns)
                    os.rename(newest, target)
                    candidates.remove(newest)
                    sync_dir(parent)
                    break
        # Never swapped in: a new preset that lost to the target, whole.
        leftovers = unlocked(beside, f".{name}.saving-", held) + new
        if os.path.isdir(target):
            inside = entries(target, OURS)
            leftovers += unlocked(inside, _INSIDE_STAGING, held)
            leftovers += unlocked(inside, _INSIDE_READY, held)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(target, _APPLYING + ".tmp"))
            for folder in old:
                _retire(folder, target)
            _unmark_new(target)
        for folder in leftovers:
            remove_tree(folder)


def _in_place_reason(target):
    if not os.path.isdir(target):
        return None
    if os.path.ismount(target):
        return f"{target!r} is a mount point"
    with contextlib.suppress(OSError):
        cwd = os.path.realpath(os.getcwd())
        if os.path.commonpath([cwd, target]) == target:
            return f"it holds the working directory {cwd!r}"
    return None


def _adopt_mode(staging, target):
    """Give `staging` the mode and owner of the folder it replaces, if any."""
    try:
        old = os.stat(target)
    except FileNotFoundError:
        return  # mkdir gave it 0o777 & ~umask, as keras-hub's makedirs does
    os.chmod(staging, old.st_mode & 0o7777)
    new = os.stat(staging)
    if (new.st_uid, new.st_gid) != (old.st_uid, old.st_gid):
        with contextlib.suppress(OSError):
            os.chown(staging, old.st_uid, old.st_gid)


def _swap(ready, target):
    """Put the complete folder `ready` at `target`; retire the old `target`."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os.rename(ready, target)
        sync_dir(parent)
        _unmark_new(target)
        return
    fd = os.open(target, os.O_RDONLY)
    try:
        # Lock the old folder: a concurrent `recover` leaves it alone while it
        # is moved aside (it then holds the only complete copy).
        flock(fd, blocking=True)
        if _exchange(ready, target):
            old = ready
        else:
            old = renamed(ready, ".ready-", ".old-")
            os.rename(target, old)
            try:
                os.rename(ready, target)
            except BaseException:
                os.rename(old, target)
                raise
        sync_dir(parent)
        _retire(old, target)
        _unmark_new(target)
    finally:
        os.close(fd)


def _exchange(a, b):
    """Swap the names `a` and `b` in one step; False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(
        _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE
    ):
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.EXDEV, errno.ENOTSUP):
            return False
        raise OSError(code, os.strerror(code), b)
    return True


def _touch(path):
    with open(path, "w"):
        pass


def _is_new(folder):
    """Whether `folder` (beside a target) is a new preset, never swapped in."""
    return os.path.lexists(os.path.join(folder, _NEW_MARKER))


def _unmark_new(target):
    """Remove the marker a swapped-in preset still holds."""
    marker = os.path.join(target, _NEW_MARKER)
    if os.path.lexists(marker):
        with writable_while(target), contextlib.suppress(OSError):
            os.unlink(marker)


def _retire(old, target):
    """Move the user's entries of the replaced folder `old` into `target`,
    then delete `old`; keep it, with a warning, if one can't be moved."""
    replaced = format_entries(old) | {n for n in list_names(old) if n.startswith(OURS)}
    kept = _carry_over(old, target, replaced)
    if kept:
        warn(
            f"Saved the preset into {target!r}, but {len(kept)} entries of the "
            f"folder it replaced could not be moved into it: {kept[:5]}. They "
            f"are kept in {old!r}; move them into {target!r} by hand.",
        )
        return
    remove_tree(old)


def _carry_over(old, new, replaced=frozenset()):
    """Move the entries of `old` that `new` lacks into `new`, merging the
    folders both hold; skip the names in `replaced`. Returns the entries
    that could not be moved."""
    kept = []
    with writable_while(old), writable_while(new):
        for name in list_names(old):
            source, destination = os.path.join(old, name), os.path.join(new, name)
            if name in replaced:
                continue
            if is_folder(source) and is_folder(destination):
                kept += _carry_over(source, destination)
            elif not os.path.lexists(destination):  # else: the new one wins
                try:
                    _move(source, destination)
                except FileNotFoundError:
                    pass
                except OSError:
                    kept.append(source)
    return kept


def _move(source, destination):
    """Rename `source` to `destination`; a folder moved to another parent
    must be writable (its `..` changes): one of this user's is made so for
    the move, and keeps its mode."""
    if not is_folder(source) or os.access(source, os.W_OK):
        os.rename(source, destination)
        return
    mode = os.stat(source).st_mode & 0o7777
    os.chmod(source, mode | 0o700)
    try:
        os.rename(source, destination)
    except BaseException:
        os.chmod(source, mode)
        raise
    os.chmod(destination, mode)


def _in_place_plan(ready, target):
    """What a move in place of `ready` into `target` does: the new files and
    folders, and the old files of the format the new preset doesn't write."""
    files, folders = walk_tree(ready)
    written = {path.split(os.sep)[0] for path in files + folders}
    stale = sorted(format_entries(target) - written)
    return {
        "ready": os.path.basename(ready),
        "files": files,
        "folders": folders,
        "stale": stale,
    }


def _apply_in_place(ready, target, plan):
    """Move the files of `ready` into `target`, `config.json` last.

    Resumable: the marker file records the plan, and a second run after a
    kill moves what is left.
    """
    marker = os.path.join(target, _APPLYING)
    if _marker(target) is None:
        with open(marker + ".tmp", "w") as f:
            json.dump(plan, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + ".tmp", marker)
        sync_dir(target)
    files = set(plan["files"])

    def pending(path):
        return os.path.lexists(os.path.join(ready, path))

    if (CONFIG_FILE in files and pending(CONFIG_FILE)) or CONFIG_FILE in plan["stale"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(target, CONFIG_FILE))
        sync_dir(target)
    for name in plan["stale"]:
        with contextlib.suppress(FileNotFoundError):
            remove_entry(os.path.join(target, name))
    for path in plan["folders"]:
        destination = os.path.join(target, path)
        if os.path.lexists(destination) and not is_folder(destination):
            remove_entry(destination)  # a file where the new preset has a folder
        os.makedirs(destination, exist_ok=True)
    touched = {target}
    for path in sorted(files - {CONFIG_FILE}):
        if pending(path):
            destination = os.path.join(target, path)
            if is_folder(destination):
                remove_entry(destination)  # a folder where the new preset has a file
            os.replace(os.path.join(ready, path), destination)
            touched.add(os.path.dirname(destination))
    for folder in sorted(touched):
        sync_dir(folder)
    if pending(CONFIG_FILE):
        os.replace(os.path.join(ready, CONFIG_FILE), os.path.join(target, CONFIG_FILE))
        sync_dir(target)
    os.unlink(marker)
    remove_tree(ready)


def _marker(target):
    """The plan a move in place into `target` recorded, if one is under way."""
    try:
        with open(os.path.join(target, _APPLYING)) as f:
            state = json.load(f)
        plan = {"ready": str(state["ready"])}
        if os.path.basename(plan["ready"]) != plan["ready"]:
            raise ValueError(plan["ready"])
        for key in ("files", "folders", "stale"):
            plan[key] = [_relative(path) for path in state[key]]
        return plan
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _relative(path):
    """`path` if it stays inside the folder it is relative to."""
    path = os.path.normpath(str(path))
    if os.path.isabs(path) or path.split(os.sep)[0] in ("..", ""):
        raise ValueError(path)
    return path


def _finish_in_place(target, held):
    """Complete a move in place that was cut short; False if one is running."""
    marker = os.path.join(target, _APPLYING)
    if not os.path.lexists(marker):
        return True
    plan = _marker(target)
    ready = os.path.join(target, plan["ready"]) if plan else None
    if ready is None or not os.path.isdir(ready):
        # Written before the move started, or after it ended: nothing to do.
        os.unlink(marker)
        return True
    if not unlocked([ready], _INSIDE_READY, held):
        return False
    _apply_in_place(ready, target, plan)
    return True
