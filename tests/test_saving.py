"""`save_to_preset` of bound models replaces the preset folder as a whole.

Most tests drive `keras_hub_autodist.saving.save_atomically` with a fake
`save` that writes files; two use a real bound tiny model.
"""

import contextlib
import errno
import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_autodist import saving
from keras_hub_autodist.errors import SaveTargetError

MESH = {"batch": 2, "model": 4}
PACKAGE_DIR = os.path.dirname(saving.__file__)

OLD = {
    "config.json": "old config",
    "metadata.json": "old metadata",
    "task.json": "old task",
    "model.weights.h5": "old weights",
    "tokenizer.json": "old tokenizer",
    "assets/tokenizer/vocabulary.spm": "old vocabulary",
}
# A sharded save: keras-hub loads `model.weights.h5` first if it exists.
NEW = {
    "config.json": "new config",
    "metadata.json": "new metadata",
    "task.json": "new task",
    "model.weights.json": "new shard index",
    "model_00000.weights.h5": "new shard 0",
    "model_00001.weights.h5": "new shard 1",
    "tokenizer.json": "new tokenizer",
    "assets/tokenizer/vocabulary.spm": "new vocabulary",
}
# Files of the user beside an old preset: kept, as keras-hub keeps them.
USER = {"README.md": "my notes", ".git/HEAD": "ref: refs/heads/main"}


def write(folder, files):
    for name, content in files.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)


def snapshot(folder):
    """{relative path: content} of every file below `folder`."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path) as f:
                found[os.path.relpath(path, folder)] = f.read()
    return found


def fake_save(files):
    def save(folder):
        write(folder, files)
        return "saved"

    return save


def modes(folder):
    """{relative path: mode} of `folder` and everything below it."""
    found = {".": os.stat(folder).st_mode}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = os.stat(path).st_mode
    return found


@contextlib.contextmanager
def umask(value):
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


# Real bound models.


def test_bound_task_saves_over_an_existing_preset_with_assets(
    tiny_presets_dir, tmp_path
):
    target = tmp_path / "preset"
    shutil.copytree(tiny_presets_dir["gemma_mqa"], target)
    assert (target / "assets" / "tokenizer").is_dir()
    lm = keras_hub.models.CausalLM.from_preset(str(target), device_mesh=MESH)
    embeddings = lm.backbone.token_embedding.embeddings
    embeddings.assign(embeddings.value + 1.0)
    expected = {w.path: np.asarray(w.value) for w in lm.backbone.weights}

    lm.save_to_preset(str(target))

    assert sorted(os.listdir(tmp_path)) == ["preset"]
    again = keras_hub.models.CausalLM.from_preset(str(target))
    loaded = {w.path: np.asarray(w.value) for w in again.backbone.weights}
    assert loaded.keys() == expected.keys()
    for path in expected:
        np.testing.assert_array_equal(loaded[path], expected[path], err_msg=path)
    assert keras.distribution.distribution() is None


def test_permissions_match_keras_hub_save(tiny_presets_dir, tmp_path):
    """A new folder and a replaced one get the modes keras-hub's save gives."""
    preset = tiny_presets_dir["gemma_mqa"]
    plain = keras_hub.models.Backbone.from_preset(preset)
    bound = keras_hub.models.Backbone.from_preset(preset, device_mesh=MESH)
    with umask(0o002):  # not the usual 0o022: nothing here is hard-coded
        for name in ("keras_hub_existing", "bound_existing"):
            (tmp_path / name).mkdir()
            os.chmod(tmp_path / name, 0o750)
        plain.save_to_preset(str(tmp_path / "keras_hub_new"))
        plain.save_to_preset(str(tmp_path / "keras_hub_existing"))
        bound.save_to_preset(str(tmp_path / "bound_new"))
        bound.save_to_preset(str(tmp_path / "bound_existing"))
    assert modes(tmp_path / "bound_new") == modes(tmp_path / "keras_hub_new")
    assert modes(tmp_path / "bound_existing") == modes(tmp_path / "keras_hub_existing")
    assert sorted(os.listdir(tmp_path)) == [
        "bound_existing",
        "bound_new",
        "keras_hub_existing",
        "keras_hub_new",
    ]


# The folder as a whole, with a fake save.


def test_sharded_save_over_an_unsharded_preset_drops_the_stale_weights(tmp_path):
    target = tmp_path / "preset"
    write(target, {**OLD, **USER})

    def failing(folder):
        write(folder, {"config.json": "half"})
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        saving.save_atomically(failing, target)
    assert snapshot(target) == {**OLD, **USER}
    assert os.listdir(tmp_path) == ["preset"]

    result = saving.save_atomically(fake_save(NEW), target)
    assert result == "saved"
    assert snapshot(target) == {**NEW, **USER}
    assert os.listdir(tmp_path) == ["preset"]


def test_a_folder_that_is_no_preset_keeps_its_files(tmp_path):
    """Like keras-hub's save: files the save writes win, others are kept.

    Weight files are the exception: one left in the folder would be loaded
    with the new config.
    """
    target = tmp_path / "out"
    mine = {"keep.txt": "mine", "notes.json": "{}", "assets/logo.png": "png"}
    write(target, {**mine, "model.weights.h5": "stray weights"})
    saving.save_atomically(fake_save(NEW), target)
    assert snapshot(target) == {**NEW, "keep.txt": "mine", "notes.json": "{}"}


def test_new_folder_mode_follows_the_umask_and_old_mode_is_kept(tmp_path):
    """What keras-hub's `os.makedirs(preset_dir, exist_ok=True)` gives."""
    with umask(0o027):
        os.makedirs(tmp_path / "reference")
        saving.save_atomically(fake_save(NEW), tmp_path / "new")
    assert os.stat(tmp_path / "new").st_mode == os.stat(tmp_path / "reference").st_mode
    write(tmp_path / "old", OLD)
    os.chmod(tmp_path / "old", 0o2751)
    saving.save_atomically(fake_save(NEW), tmp_path / "old")
    assert os.stat(tmp_path / "old").st_mode & 0o7777 == 0o2751


def test_a_file_as_target_is_an_error(tmp_path):
    target = tmp_path / "preset"
    target.write_text("not a folder")
    with pytest.raises(
        SaveTargetError,
        match=r"is not a folder.*Received: preset_dir='.*preset'",
    ):
        saving.save_atomically(fake_save(NEW), str(target))
    assert target.read_text() == "not a folder"
    assert os.listdir(tmp_path) == ["preset"]


def deny_mkdir_in(monkeypatch, parent):
    """`os.mkdir` fails in `parent` the way it does in a read-only folder.

    Tests run as root, where `chmod 0o555` does not stop writes, so the error
    a non-root user gets from `mkdir` in such a folder is raised instead.
    """
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == str(parent):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


def test_read_only_parent_writes_in_place_like_keras_hub(tmp_path, monkeypatch):
    """A writable preset folder in a read-only folder is written in place.

    keras-hub writes there; so does the save, with a warning, and with no
    stale file left.
    """
    parent = tmp_path / "read_only"
    target = parent / "preset"
    write(target, {**OLD, **USER})
    inode = os.stat(target).st_ino
    os.chmod(parent, 0o555)
    deny_mkdir_in(monkeypatch, parent)
    with pytest.warns(UserWarning, match=r"in place.*read_only' is not writable"):
        assert saving.save_atomically(fake_save(NEW), target) == "saved"
    assert snapshot(target) == {**NEW, **USER}
    assert os.stat(target).st_ino == inode
    assert os.listdir(parent) == ["preset"]
    # A missing folder can't be created there, by keras-hub either.
    with pytest.raises(PermissionError):
        saving.save_atomically(fake_save(NEW), parent / "other")
    assert os.listdir(parent) == ["preset"]


@pytest.mark.parametrize("reason", ["working directory", "mount point"])
def test_folders_that_cant_be_renamed_are_written_in_place(
    tmp_path, monkeypatch, reason
):
    target = tmp_path / "preset"
    write(target, {**OLD, **USER})
    if reason == "working directory":
        monkeypatch.chdir(target)
    else:
        real_ismount = os.path.ismount
        monkeypatch.setattr(
            os.path, "ismount", lambda p: p == str(target) or real_ismount(p)
        )
    with pytest.warns(UserWarning, match=f"in place.*{reason}"):
        saving.save_atomically(
            fake_save(NEW), "." if reason == "working directory" else target
        )
    assert snapshot(target) == {**NEW, **USER}
    assert os.listdir(tmp_path) == ["preset"]


def lock(path):
    """Hold `path` as a running save does."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_leftovers_of_killed_saves_are_cleaned_up(tmp_path):
    target = tmp_path / "preset"
    write(target, OLD)
    write(tmp_path / ".preset.saving-0badc0de", {"config.json": "half"})
    write(tmp_path / ".preset.ready-00c0ffee", NEW)
    write(tmp_path / ".preset.old-0ddba11a", {**OLD, **USER})
    write(target / ".autodist-saving-deadbeef", {"config.json": "half"})
    # A save still running, and folders of another preset: left alone.
    running = lock(tmp_path / ".preset.saving-11111111")
    write(tmp_path / ".preset.v2.saving-22222222", {"config.json": "other"})
    try:
        saving.save_atomically(fake_save(NEW), target)
        assert snapshot(target) == {**NEW, **USER}
        assert sorted(os.listdir(tmp_path)) == [
            ".preset.saving-11111111",
            ".preset.v2.saving-22222222",
            "preset",
        ]
    finally:
        os.close(running)


def test_a_missing_target_is_restored_from_the_folder_moved_aside(tmp_path):
    """A kill between 'old folder aside' and 'new folder in' left no target.

    The next save (or `recover`) puts the complete old preset back, so a save
    that then fails leaves the old preset, as it should.
    """
    target = tmp_path / "preset"
    write(tmp_path / ".preset.old-0ddba11a", OLD)

    def failing(folder):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        saving.save_atomically(failing, target)
    assert snapshot(target) == OLD
    assert os.listdir(tmp_path) == ["preset"]


# SIGKILL at random points.

CHILD = textwrap.dedent(
    """
    import os, sys, time, types

    # The saving module alone: no keras import, so each run is fast.
    package = types.ModuleType("keras_hub_autodist")
    package.__path__ = [sys.argv[1]]
    sys.modules["keras_hub_autodist"] = package
    from keras_hub_autodist import saving

    target, mode, files = sys.argv[2], sys.argv[3], eval(sys.argv[4])
    parent = os.path.realpath(os.path.dirname(target))
    real_rename, real_mkdir = os.rename, os.mkdir

    def rename(a, b):  # widen the windows between renames
        real_rename(a, b)
        time.sleep(0.002)

    def mkdir(path, mode=0o777, **kwargs):  # a read-only parent
        if os.path.dirname(path) == parent:
            raise PermissionError(13, "Permission denied", path)
        return real_mkdir(path, mode, **kwargs)

    os.rename = rename
    if mode == "two renames":
        saving._exchange = lambda a, b: False
    if mode == "in place":
        os.mkdir = mkdir

    def save(folder):
        for name, content in files.items():
            path = os.path.join(folder, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            time.sleep(0.003)

    print("go", flush=True)
    saving.save_atomically(save, target)
    """
)


def run_child(script, target, mode, delay=None):
    process = subprocess.Popen(
        [sys.executable, "-S", "-W", "ignore", str(script), PACKAGE_DIR]
        + [str(target), mode, repr(NEW)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "go\n", process.stderr.read()
    start = time.monotonic()
    if delay is not None:
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
    process.wait()
    stderr = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert process.returncode in (0, -signal.SIGKILL), stderr
    return time.monotonic() - start, process.returncode


def assert_sigkill_leaves_old_or_new(tmp_path, mode):
    """Kill a save at random points: the result is the old or the new preset.

    A child process saves `NEW` over `OLD` (plus the user's files) with a
    slow fake save, and is killed with SIGKILL after a random delay (16
    seeded trials per mode, over the whole length of a save).

    Right after the kill, before any recovery, the preset files in the target
    (the user's files may still be in the old folder moved aside):
    - "exchange" (Linux `renameat2`): the target is the complete old or the
      complete new preset.
    - "two renames" (no `renameat2`): the same, or no target at all if the
      kill fell between the two renames.
    - "in place" (read-only parent): the same, or a folder without
      `config.json` if the kill fell while the files were moved in.
    Then `saving.recover(target)`, which every save runs first, must leave the
    complete old or the complete new preset, and nothing beside or inside it.
    """
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    parent = tmp_path / "parent"
    target = parent / "preset"
    old, new = {**OLD, **USER}, {**NEW, **USER}

    write(target, old)
    duration, code = run_child(script, target, mode)
    assert code == 0 and snapshot(target) == new

    rng = random.Random(f"sigkill-{mode}")
    outcomes = set()
    for _ in range(16):
        shutil.rmtree(parent)
        write(target, old)
        run_child(script, target, mode, delay=rng.uniform(0, 1.2 * duration))
        found = None
        if os.path.isdir(target):
            found = {
                name: content
                for name, content in snapshot(target).items()
                if name not in USER and ".autodist-" not in name
            }
        if found not in (OLD, NEW):
            if mode == "two renames":
                assert found is None
            elif mode == "in place":
                assert found is not None and "config.json" not in found
            else:
                raise AssertionError(f"neither old nor new: {found}")
        saving.recover(target)
        after = snapshot(target)
        assert after in (old, new)
        outcomes.add("new" if after == new else "old")
        assert os.listdir(parent) == ["preset"]
        assert not [n for n in os.listdir(target) if n.startswith(".autodist-")]
    assert outcomes == {"old", "new"}


def test_sigkill_at_random_points_leaves_old_or_new(tmp_path):
    """Linux `renameat2` exchanges the folders (the other two modes run in
    integration/test_saving_sigkill.py)."""
    assert_sigkill_leaves_old_or_new(tmp_path, "exchange")
