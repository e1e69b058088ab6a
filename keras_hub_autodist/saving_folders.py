"""The file-system pieces of atomic saves (`saving.py`): staging folders
locked while a save runs, folders listed, merged, made writable, flushed to
disk and removed.

Example:
```python
folder, fd = new_folder("/tmp", ".preset.saving-")  # created, and locked
remove_tree(folder)
```
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux or macOS
    fcntl = None

# The random part of a staging folder's name, in bytes.
TOKEN_BYTES = 4
# Entries of the package inside a preset folder start with this.
OURS = ".autodist-"
# Owner read, write and search: what moving entries in and out of a folder needs.
_OWNER_RWX = 0o700


def renamed(path, part, replacement):
    """`path` with the last `part` of its name replaced (before the token)."""
    head, tail = os.path.split(path)
    at = tail.rfind(part)
    return os.path.join(head, tail[:at] + replacement + tail[at + len(part) :])


def new_folder(where, prefix):
    """Create `where/prefix<random>` (mode `0o777 & ~umask`) and lock it."""
    while True:
        path = os.path.join(where, prefix + secrets.token_hex(TOKEN_BYTES))
        try:
            os.mkdir(path, 0o777)
        except FileExistsError:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed by a cleanup that came first
        flock(fd, blocking=True)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        os.close(fd)


def flock(fd, blocking):
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


def unlocked(paths, prefix, held):
    """The `paths` starting with `prefix` that no running save holds."""
    found = []
    for path in paths:
        name = os.path.basename(path)
        token = name[len(prefix) :]
        if not name.startswith(prefix) or not is_token(token):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        held.callback(os.close, fd)
        if flock(fd, blocking=False):
            found.append(path)
    return found


def is_token(text):
    hexdigits = "0123456789abcdef"
    return len(text) == 2 * TOKEN_BYTES and all(c in hexdigits for c in text)


def entries(folder, prefix):
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith(prefix)]


def list_names(folder):
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def is_folder(path):
    return os.path.isdir(path) and not os.path.islink(path)


@contextlib.contextmanager
def writable_while(folder):
    """Let this user create and remove entries in `folder` (owned by them)
    for the duration, then give it its mode back. Best effort."""
    mode = None
    if os.path.isdir(folder) and not os.access(folder, os.W_OK | os.X_OK):
        with contextlib.suppress(OSError):
            mode = os.stat(folder).st_mode & 0o7777
            os.chmod(folder, mode | _OWNER_RWX)
    try:
        yield
    finally:
        if mode is not None:
            with contextlib.suppress(OSError):
                os.chmod(folder, mode)


def remove_entry(path):
    if is_folder(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def remove_tree(path):
    """Delete `path` and everything below it, making folders this user owns
    writable where needed. Best effort, like `shutil.rmtree(ignore_errors)`."""

    def retry(function, failed, _):
        with contextlib.suppress(OSError):
            for folder in (os.path.dirname(failed), failed):
                if is_folder(folder) and not os.access(folder, os.W_OK | os.X_OK):
                    os.chmod(folder, os.stat(folder).st_mode | _OWNER_RWX)
            if is_folder(failed):
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    if not is_folder(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(OSError):
        if not os.access(path, os.W_OK | os.X_OK):
            os.chmod(path, os.stat(path).st_mode | _OWNER_RWX)
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def walk_tree(root):
    """The files (and links) and the folders below `root`, as relative paths,
    without the package's own entries at its top."""
    files, folders = [], []
    for folder, dirs, names in os.walk(root):
        relative = os.path.relpath(folder, root)
        if relative == ".":
            dirs[:] = [d for d in dirs if not d.startswith(OURS)]
            names = [n for n in names if not n.startswith(OURS)]
        for name in sorted(dirs):
            path = os.path.normpath(os.path.join(relative, name))
            if os.path.islink(os.path.join(folder, name)):
                files.append(path)
            else:
                folders.append(path)
        files += [os.path.normpath(os.path.join(relative, n)) for n in sorted(names)]
    return sorted(files), sorted(folders)


def sync_dir(path):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_tree(root):
    """Flush every file and folder under `root` to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        sync_dir(folder)
