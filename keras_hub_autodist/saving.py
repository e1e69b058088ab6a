"""Replace a preset folder as a whole, so readers never see old and new mixed.

`save_atomically(save, preset_dir)` runs `save` into a staging folder beside
`preset_dir`, then swaps the complete new folder in by renames:

1. `save(".NAME.saving-XXXX")` writes the new preset, then everything in it is
   flushed to disk (`fsync`) and the folder is renamed `.NAME.ready-XXXX`:
   it is complete.
2. The ready folder and `NAME` are exchanged in one step with Linux's
   `renameat2(RENAME_EXCHANGE)`. Where that call is missing, `NAME` is renamed
   to `.NAME.old-XXXX`, then the ready folder to `NAME`; between these two
   renames (microseconds) `NAME` does not exist, and a reader sees a missing
   preset, never a mix.
3. Files of the old folder that are not preset files (`README.md`, `.git`,
   notes...) are moved into the new folder, as keras-hub's in-place save would
   keep them; preset files (`*.json`, `*.h5`, `assets/` of an old preset) are
   dropped with the old folder. A stale `model.weights.h5` never survives a
   sharded save.

Every save first calls `recover(preset_dir)`, which resolves what a killed save
left behind: when `NAME` is missing, a `.NAME.ready-*` folder (a complete new
preset) or else a `.NAME.old-*` folder (the complete old one) is renamed back
to `NAME`; then leftover staging, ready and old folders are deleted (after their
non-preset files were moved into `NAME`). A complete copy is never deleted while
`NAME` is missing. Folders of saves still running are left alone: each save
holds an `flock` on its folders, and only unlocked leftovers are touched.

The new folder gets the mode keras-hub's `os.makedirs` would give it
(`0o777 & ~umask`), or the mode (and owner) of the folder it replaces, which
keras-hub keeps too.

When a folder can't be created beside `NAME` (a read-only parent folder),
`NAME` is a mount point, or `NAME` holds the working directory, the preset is
written in place, as keras-hub does, with a `UserWarning`: the new files are
staged in `NAME/.autodist-saving-XXXX`, then `config.json` is removed first and
put back last. A reader then sees the old preset, the new one, or, if a kill
hits while the files are moved, a folder without `config.json` that no loader
accepts, until the next save (or `recover`) completes the move.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from typing import Any

from keras_hub_autodist.errors import SaveTargetError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None

CONFIG_FILE = "config.json"
# Inside a folder written in place: the staged files, and the marker saying
# that a move of the staged files into the folder is under way.
_INSIDE_STAGING = ".autodist-saving-"
_INSIDE_READY = ".autodist-ready-"
_APPLYING = ".autodist-applying"
# The staging folders of the saves running in this thread or task.
_STAGING = contextvars.ContextVar("keras_hub_autodist_staging", default=())
_TOKEN_BYTES = 4
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def save_atomically(
    save: Callable[..., Any], preset_dir: str | os.PathLike, *args, **kwargs
) -> Any:
    """Run `save(folder, *args, **kwargs)`, then swap the folder in as `preset_dir`.

    A reader of `preset_dir` sees the complete old preset or the complete new
    one, whenever the process dies. An error while saving leaves `preset_dir`
    as it was. The module docstring describes the steps, what a killed save
    leaves behind and how the next save resolves it, and the in-place mode
    used under a read-only parent folder.

    Args:
        save: writes a preset into the folder it receives first, e.g. the
            unbound `save_to_preset` method of a keras-hub model.
        preset_dir: the folder the preset ends up in; created if missing.
        *args: passed to `save` after the folder.
        **kwargs: passed to `save`.

    Returns:
        What `save` returned.

    Example:
    ```python
    save_atomically(model.save_to_preset, "./tuned", max_shard_size=2)
    ```
    """
    target = os.path.realpath(os.fspath(preset_dir))
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
    os.makedirs(parent, exist_ok=True)
    recover(target)
    reason = _in_place_reason(target)
    staging = None
    if reason is None:
        try:
            staging, lock = _new_folder(parent, f".{name}.saving-")
        except PermissionError:
            if not os.path.isdir(target):
                raise
            reason = f"the parent folder {parent!r} is not writable"
    if reason is not None:
        warnings.warn(
            f"Saving into {target!r} in place, as keras-hub does, because "
            f"{reason}. If the process dies while the files are moved in, the "
            f"folder has no {CONFIG_FILE} (no loader accepts it) until the next "
            "save into it completes the move; old and new files are never "
            "mixed in a folder that has one.",
            stacklevel=3,
        )
        staging, lock = _new_folder(target, _INSIDE_STAGING)
    try:
        if reason is None:
            _adopt_mode(staging, target)
        token = _STAGING.set((*_STAGING.get(), staging))
        try:
            result = save(staging, *args, **kwargs)
        finally:
            _STAGING.reset(token)
        _sync_tree(staging)
        ready = _renamed(staging, "saving-", "ready-")
        os.rename(staging, ready)
        staging = ready
        if reason is None:
            _swap(ready, target)
        else:
            _apply_in_place(ready, target, _is_preset(target))
        return result
    finally:
        with contextlib.suppress(FileNotFoundError):
            ours = os.path.samestat(os.fstat(lock), os.stat(staging))
            if ours and (_marker(target) or {}).get("ready") != os.path.basename(
                staging
            ):
                # Not swapped in: `preset_dir` is as it was. A move in place
                # that failed half-way is left for `recover` to finish.
                shutil.rmtree(staging, ignore_errors=True)
        os.close(lock)


def recover(preset_dir: str | os.PathLike) -> None:
    """Resolve what saves into `preset_dir` that were killed left behind.

    Called by every save before it writes. When `preset_dir` is missing, the
    newest complete copy beside it (a ready new preset, else the old one moved
    aside) is renamed back to `preset_dir`; a move in place that was cut short
    is completed. Then leftover folders of dead saves are deleted, after their
    non-preset files were moved into `preset_dir`. Folders that a running
    save holds are not touched.

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
        beside = _entries(parent, f".{name}.")
        ready = _unlocked(beside, f".{name}.ready-", held)
        old = _unlocked(beside, f".{name}.old-", held)
        if not os.path.lexists(target):
            for candidates in (ready, old):
                if candidates:
                    newest = max(candidates, key=lambda p: os.stat(p).st_mtime_ns)
                    os.rename(newest, target)
                    candidates.remove(newest)
                    _sync_dir(parent)
                    break
        leftovers = _unlocked(beside, f".{name}.saving-", held)
        if os.path.isdir(target):
            inside = _entries(target, ".autodist-")
            leftovers += _unlocked(inside, _INSIDE_STAGING, held)
            leftovers += _unlocked(inside, _INSIDE_READY, held)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(target, _APPLYING + ".tmp"))
            for folder in ready + old:
                _carry_over(folder, target)
            leftovers += ready + old
        for folder in leftovers:
            shutil.rmtree(folder, ignore_errors=True)


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


def _renamed(path, part, replacement):
    """`path` with the last `part` of its name replaced (before the token)."""
    head, tail = os.path.split(path)
    at = tail.rfind(part)
    return os.path.join(head, tail[:at] + replacement + tail[at + len(part) :])


def _new_folder(where, prefix):
    """Create `where/prefix<random>` (mode `0o777 & ~umask`) and lock it."""
    while True:
        path = os.path.join(where, prefix + secrets.token_hex(_TOKEN_BYTES))
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed by a cleanup that came first
        _flock(fd, blocking=True)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        os.close(fd)


def _flock(fd, blocking):
    """Lock `fd`; False if another process holds it. True where unsupported."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:
        return True  # no locks on this filesystem: no protection either
    return True


def _unlocked(paths, prefix, held):
    """The `paths` starting with `prefix` that no running save holds."""
    found = []
    for path in paths:
        name = os.path.basename(path)
        token = name[len(prefix) :]
        if not name.startswith(prefix) or not _is_token(token):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        held.callback(os.close, fd)
        if _flock(fd, blocking=False):
            found.append(path)
    return found


def _is_token(text):
    hexdigits = "0123456789abcdef"
    return len(text) == 2 * _TOKEN_BYTES and all(c in hexdigits for c in text)


def _entries(folder, prefix):
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith(prefix)]


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
    """Put the complete folder `ready` at `target`; drop the old `target`."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os.rename(ready, target)
        _sync_dir(parent)
        return
    fd = os.open(target, os.O_RDONLY)
    try:
        # Lock the old folder: a concurrent `recover` leaves it alone while it
        # is moved aside (it then holds the only complete copy).
        _flock(fd, blocking=True)
        if _exchange(ready, target):
            old = ready
        else:
            old = _renamed(ready, ".ready-", ".old-")
            os.rename(target, old)
            try:
                os.rename(ready, target)
            except BaseException:
                os.rename(old, target)
                raise
        _sync_dir(parent)
        _carry_over(old, target)
        shutil.rmtree(old, ignore_errors=True)
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


def _is_preset(folder):
    return os.path.isfile(os.path.join(folder, CONFIG_FILE))


def _is_stale(name, old_is_preset):
    """Whether `name` in an old folder is a file of the old preset."""
    if name.startswith(".autodist-"):
        return True
    if name.endswith((".weights.h5", ".weights.json")):
        return True  # would be loaded with the new config: never kept
    return old_is_preset and (name.endswith((".json", ".h5")) or name == "assets")


def _carry_over(old, target):
    """Move the non-preset entries of `old` missing from `target` into it."""
    old_is_preset = _is_preset(old)
    for name in _entries(old, ""):
        name = os.path.basename(name)
        destination = os.path.join(target, name)
        if _is_stale(name, old_is_preset) or os.path.lexists(destination):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.rename(os.path.join(old, name), destination)


def _apply_in_place(ready, target, old_is_preset):
    """Move the files of `ready` into `target`, `config.json` last.

    Resumable: the marker file records what is moved, and a second run after
    a kill moves what is left.
    """
    marker = os.path.join(target, _APPLYING)
    state = _marker(target)
    if state is None:
        state = {
            "ready": os.path.basename(ready),
            "preset": old_is_preset,
            "names": sorted(os.listdir(ready)),
        }
        with open(marker + ".tmp", "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker + ".tmp", marker)
        _sync_dir(target)
    names = set(state["names"])

    def pending(name):
        return os.path.lexists(os.path.join(ready, name))

    if CONFIG_FILE not in names or pending(CONFIG_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(target, CONFIG_FILE))
        _sync_dir(target)
    for name in os.listdir(target):
        if name.startswith(".autodist-") or name == CONFIG_FILE:
            continue
        if pending(name) if name in names else _is_stale(name, state["preset"]):
            _remove(os.path.join(target, name))
    for name in sorted(names - {CONFIG_FILE}):
        if pending(name):
            os.rename(os.path.join(ready, name), os.path.join(target, name))
    _sync_dir(target)
    if pending(CONFIG_FILE):
        os.rename(os.path.join(ready, CONFIG_FILE), os.path.join(target, CONFIG_FILE))
        _sync_dir(target)
    os.unlink(marker)
    os.rmdir(ready)


def _marker(target):
    """The state a move in place into `target` recorded, if one is under way."""
    try:
        with open(os.path.join(target, _APPLYING)) as f:
            state = json.load(f)
        return {
            "ready": str(state["ready"]),
            "preset": bool(state["preset"]),
            "names": [str(n) for n in state["names"]],
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _finish_in_place(target, held):
    """Complete a move in place that was cut short; False if one is running."""
    marker = os.path.join(target, _APPLYING)
    if not os.path.lexists(marker):
        return True
    state = _marker(target)
    ready = os.path.join(target, state["ready"]) if state else None
    if ready is None or not os.path.isdir(ready):
        # Written before the move started, or after it ended: nothing to do.
        os.unlink(marker)
        return True
    if not _unlocked([ready], _INSIDE_READY, held):
        return False
    _apply_in_place(ready, target, state["preset"])
    return True


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _sync_dir(path):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sync_tree(root):
    """Flush every file and folder under `root` to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _sync_dir(folder)
