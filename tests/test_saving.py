"""`save_to_preset` of bound models replaces the preset folder as a whole.

Most tests drive `keras_hub_autodist.saving.atomic.save_atomically` with a fake
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

from keras_hub_autodist.errors import SavePermissionError
from keras_hub_autodist.errors import SaveTargetError
from keras_hub_autodist.saving import atomic
from keras_hub_autodist.training import fingerprint

MESH = {"batch": 2, "model": 4}
PACKAGE_DIR = os.path.dirname(os.path.dirname(atomic.__file__))

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
    """{relative path: content} of every file below `folder` (text, or the
    bytes of a binary file)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                content = f.read()
            with contextlib.suppress(UnicodeDecodeError):
                content = content.decode()
            found[os.path.relpath(path, folder)] = content
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
    # A preset is keras-hub's format: no fingerprint in its weights, which a
    # weights file of the same model holds.
    assert _root_datasets(target) == []
    lm.save_weights(str(tmp_path / "run.weights.h5"))
    assert fingerprint.STORED_NAME in _root_datasets(tmp_path / "run.weights.h5")


def _root_datasets(path):
    """The names at the root of each HDF5 file at `path` (a file or folder)."""
    import h5py

    files = sorted(path.rglob("*.h5")) if path.is_dir() else [path]
    assert files
    names = []
    for file in files:
        with h5py.File(file, "r") as f:
            names += [n for n in f if isinstance(f[n], h5py.Dataset)]
    return names


def test_a_bound_model_saved_into_its_own_preset_folder(
    tiny_presets_dir, tmp_path, monkeypatch
):
    """Loaded from `./preset`, saved sharded into `.` (the preset itself, the
    working folder: written in place): the user's files stay, the old
    unsharded weights go, and the preset loads the model's weights."""
    target = tmp_path / "preset"
    shutil.copytree(tiny_presets_dir["gemma_mqa"], target)
    write(target, USER_FILES)
    monkeypatch.chdir(target)
    backbone = keras_hub.models.Backbone.from_preset(".", device_mesh=MESH)
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(embeddings.value + 1.0)
    expected = {w.path: np.asarray(w.value) for w in backbone.weights}
    before = snapshot(target)

    with pytest.raises(SaveTargetError, match="empty"):
        backbone.save_to_preset("")
    assert snapshot(target) == before
    with pytest.warns(UserWarning, match="in place"):
        backbone.save_to_preset(".", max_shard_size=1e-5)

    files = snapshot(target)
    assert {k: files.get(k) for k in USER_FILES} == USER_FILES
    assert "model.weights.h5" not in files and "model.weights.json" in files
    again = keras_hub.models.Backbone.from_preset(str(target))
    for weight in again.weights:
        np.testing.assert_array_equal(
            np.asarray(weight.value), expected[weight.path], err_msg=weight.path
        )
    assert sorted(os.listdir(tmp_path)) == ["preset"]


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
        atomic.save_atomically(failing, target)
    assert snapshot(target) == {**OLD, **USER}
    assert os.listdir(tmp_path) == ["preset"]

    result = atomic.save_atomically(fake_save(NEW), target)
    assert result == "saved"
    assert snapshot(target) == {**NEW, **USER}
    assert os.listdir(tmp_path) == ["preset"]


def test_a_folder_that_is_no_preset_keeps_its_files(tmp_path):
    """Like keras-hub's save: files the save writes win, others are kept.

    Files of the preset format are the exception: a `model.weights.h5` left
    beside a sharded save would be loaded with the new config.
    """
    target = tmp_path / "out"
    mine = {"keep.txt": "mine", "notes.json": "{}", "assets/logo.png": "png"}
    write(target, {**mine, "model.weights.h5": "stray weights"})
    atomic.save_atomically(fake_save(NEW), target)
    assert snapshot(target) == {**NEW, **mine}


def test_new_folder_mode_follows_the_umask_and_old_mode_is_kept(tmp_path):
    """What keras-hub's `os.makedirs(preset_dir, exist_ok=True)` gives."""
    with umask(0o027):
        os.makedirs(tmp_path / "reference")
        atomic.save_atomically(fake_save(NEW), tmp_path / "new")
    assert os.stat(tmp_path / "new").st_mode == os.stat(tmp_path / "reference").st_mode
    write(tmp_path / "old", OLD)
    os.chmod(tmp_path / "old", 0o2751)
    atomic.save_atomically(fake_save(NEW), tmp_path / "old")
    assert os.stat(tmp_path / "old").st_mode & 0o7777 == 0o2751


def test_a_file_as_target_is_an_error(tmp_path):
    target = tmp_path / "preset"
    target.write_text("not a folder")
    with pytest.raises(
        SaveTargetError,
        match=r"is not a folder.*Received: preset_dir='.*preset'",
    ):
        atomic.save_atomically(fake_save(NEW), str(target))
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
        assert atomic.save_atomically(fake_save(NEW), target) == "saved"
    assert snapshot(target) == {**NEW, **USER}
    assert os.stat(target).st_ino == inode
    assert os.listdir(parent) == ["preset"]
    # A missing folder can't be created there, by keras-hub either.
    with pytest.raises(PermissionError):
        atomic.save_atomically(fake_save(NEW), parent / "other")
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
        atomic.save_atomically(
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
        atomic.save_atomically(fake_save(NEW), target)
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
        atomic.save_atomically(failing, target)
    assert snapshot(target) == OLD
    assert os.listdir(tmp_path) == ["preset"]


# Which files a save replaces, and which it keeps.

# A user's files in a preset folder, none of them a file of the format:
# kept by every save, as keras-hub's own save keeps them.
USER_FILES = {
    **USER,
    "notes.json": "{}",
    "eval_results.json": '{"loss": 1}',
    "data.h5": "user data",
    "my_lora.weights.h5": "lora weights",
    "my_lora.weights.json": "lora index",
    "model_backup.weights.h5": "a backup",
    "model.safetensors": "a Hugging Face checkpoint",
    "assets/mine/keep.txt": "mine",
    "assets/tokenizer/notes.txt": "notes beside the vocabulary",
}
# An old sharded Task preset with every file of the format; its index lists
# a shard of its own name too.
OLD_TASK = {
    "config.json": "old config",
    "metadata.json": "old metadata",
    "task.json": "old task",
    "task.weights.h5": "old task weights",
    "preprocessor.json": "old preprocessor",
    "tokenizer.json": "old tokenizer",
    "image_converter.json": "old image converter",
    "audio_converter.json": "old audio converter",
    "video_converter.json": "old video converter",
    "model.weights.json": (
        '{"metadata": {}, "weight_map": {"a": "model_00000.weights.h5", '
        '"b": ["model_00001.weights.h5", "part_b.h5"]}}'
    ),
    "model_00000.weights.h5": "old shard 0",
    "model_00001.weights.h5": "old shard 1",
    "part_b.h5": "old listed shard",
    "model_00002.weights.h5": "an old shard left by an older save",
    "assets/tokenizer/vocabulary.spm": "old vocabulary",
    "assets/tokenizer/merges.txt": "old merges",
}
# A new unsharded backbone: no task, tokenizer, preprocessor or shards.
NEW_BACKBONE = {
    "config.json": "new config",
    "metadata.json": "new metadata",
    "model.weights.h5": "new weights",
}


def save_in_mode(mode, target, files, monkeypatch):
    """`save_atomically` of `files` into `target` as each mode does it."""
    if mode == "two renames":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    if mode == "working folder":
        monkeypatch.chdir(target)
        with pytest.warns(UserWarning, match="in place"):
            return atomic.save_atomically(fake_save(files), ".")
    if mode == "read-only parent":
        deny_mkdir_in(monkeypatch, target.parent)
        with pytest.warns(UserWarning, match="in place"):
            return atomic.save_atomically(fake_save(files), target)
    return atomic.save_atomically(fake_save(files), target)


MODES = ["exchange", "two renames", "working folder", "read-only parent"]


@pytest.mark.parametrize("mode", MODES)
def test_a_save_keeps_every_file_it_does_not_replace(tmp_path, monkeypatch, mode):
    """Over a preset, only files of the format go: the user's `*.json`,
    `*.h5`, `*.weights.h5` and `assets/` files stay, as with keras-hub."""
    target = tmp_path / "preset"
    write(target, {**OLD, **USER_FILES})
    save_in_mode(mode, target, NEW, monkeypatch)
    assert snapshot(target) == {**NEW, **USER_FILES}
    assert os.listdir(tmp_path) == ["preset"]


@pytest.mark.parametrize("mode", MODES)
def test_a_folder_that_is_no_preset_keeps_its_weights_files(
    tmp_path, monkeypatch, mode
):
    target = tmp_path / "work"
    write(target, USER_FILES)
    save_in_mode(mode, target, NEW, monkeypatch)
    assert snapshot(target) == {**NEW, **USER_FILES}


@pytest.mark.parametrize("mode", MODES)
def test_no_file_of_an_older_save_is_left_for_the_new_preset_to_load(
    tmp_path, monkeypatch, mode
):
    """A backbone saved over a sharded Task preset: the old task, tokenizer,
    preprocessor, converters, index and shards would be loaded with the new
    config; all of them go. The old assets are read by name by the old
    tokenizer only, and stay, as with keras-hub."""
    target = tmp_path / "preset"
    write(target, {**OLD_TASK, **USER_FILES})
    save_in_mode(mode, target, NEW_BACKBONE, monkeypatch)
    old_assets = {k: v for k, v in OLD_TASK.items() if k.startswith("assets/")}
    assert snapshot(target) == {**NEW_BACKBONE, **old_assets, **USER_FILES}


def test_an_index_names_no_file_outside_the_shards(tmp_path):
    """Only plain `.h5` names an old index lists are its shards."""
    target = tmp_path / "preset"
    outside = tmp_path / "outside.h5"
    outside.write_text("not in the preset")
    index = (
        '{"weight_map": {"a": "README.md", "b": "../outside.h5", '
        '"c": ["sub/x.h5", ".hidden.h5", 7]}}'
    )
    kept = {"README.md": "notes", "sub/x.h5": "mine", ".hidden.h5": "mine"}
    write(target, {**OLD, "model.weights.json": index, **kept})
    atomic.save_atomically(fake_save(NEW_BACKBONE), target)
    assert snapshot(target) == {
        **NEW_BACKBONE,
        "assets/tokenizer/vocabulary.spm": "old vocabulary",
        **kept,
    }
    assert outside.read_text() == "not in the preset"


@pytest.mark.parametrize(
    "preset_dir, message",
    [
        ("", r"`preset_dir` is empty.*Received: preset_dir=''"),
        ("hf://me/model", r"URL.*Received: preset_dir='hf://me/model'"),
        ("gs://bucket/model", r"URL.*Received: preset_dir='gs://bucket/model'"),
        (None, r"local folder.*Received: preset_dir=None of type NoneType"),
        (3, r"local folder.*Received: preset_dir=3 of type int"),
    ],
)
def test_a_path_that_is_no_local_folder_is_refused(
    tmp_path, monkeypatch, preset_dir, message
):
    write(tmp_path, USER_FILES)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SaveTargetError, match=message):
        atomic.save_atomically(fake_save(NEW), preset_dir)
    assert snapshot(tmp_path) == USER_FILES


def test_a_save_that_cant_create_its_folder_names_it(tmp_path, monkeypatch):
    """keras-hub raises `PermissionError` there: so does the save, naming the
    folder asked for, not a staging folder of its own."""
    parent = tmp_path / "read_only"
    parent.mkdir()
    deny_mkdir_in(monkeypatch, parent)
    with pytest.raises(PermissionError) as raised:
        atomic.save_atomically(fake_save(NEW), parent / "preset")
    assert isinstance(raised.value, SavePermissionError)
    message = str(raised.value)
    assert f"into {str(parent / 'preset')!r}" in message
    assert "Received: preset_dir=" in message
    assert ".saving-" not in message and ".autodist-" not in message
    assert os.listdir(parent) == []


def test_a_folder_where_nothing_can_be_created_is_named(tmp_path, monkeypatch):
    """Neither beside nor inside the preset can a folder be created."""
    parent = tmp_path / "read_only"
    target = parent / "preset"
    write(target, OLD)
    deny_mkdir_in(monkeypatch, parent)
    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, **kwargs):
        if os.path.dirname(os.path.abspath(path)) == str(target):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.warns(UserWarning), pytest.raises(SavePermissionError) as raised:
        atomic.save_atomically(fake_save(NEW), target)
    assert f"into {str(target)!r}" in str(raised.value)
    assert ".autodist-" not in str(raised.value)
    assert snapshot(target) == OLD


def test_a_new_preset_that_was_never_swapped_in_is_dropped_whole(tmp_path):
    """A kill after the new preset was complete, before the swap: the next
    save drops it, and moves none of its files into the old preset."""
    target = tmp_path / "preset"
    write(target, {**OLD, **USER})
    never_swapped = tmp_path / ".preset.ready-00c0ffee"
    write(never_swapped, {**NEW, "assets/tokenizer/merges.txt": "new merges"})
    (never_swapped / ".autodist-new").write_text("")
    atomic.recover(target)
    assert snapshot(target) == {**OLD, **USER}
    assert os.listdir(tmp_path) == ["preset"]


def test_names_of_the_format_are_keras_hubs():
    """`preset_files` (imported without Keras by the save) names the files
    keras-hub's savers write and its loaders read."""
    from keras_hub_autodist import compat
    from keras_hub_autodist.saving import preset_files

    names = compat.preset_format_names()
    assert set(names.values()) - {"assets"} == set(preset_files.FORMAT_FILES)
    assert names["ASSET_DIR"] == preset_files.ASSETS_FOLDER
    assert names["SHARDED_MODEL_WEIGHTS_CONFIG_FILE"] == (
        preset_files.SHARDED_INDEX_FILE
    )


# SIGKILL during a save.

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, types

    # The saving module alone: no keras import, so each run is fast.
    package = types.ModuleType("keras_hub_autodist")
    package.__path__ = [sys.argv[1]]
    sys.modules["keras_hub_autodist"] = package
    from keras_hub_autodist.saving import atomic
    target, mode, files = sys.argv[2], sys.argv[3], eval(sys.argv[4])
    die_at = int(sys.argv[5])  # -1: run whole (slowly, to be killed from outside)
    pause = 0.0 if die_at >= 0 else 0.002
    parent = os.path.realpath(os.path.dirname(target))
    real_rename, real_mkdir = os.rename, os.mkdir

    def rename(a, b):  # widen the windows between renames
        real_rename(a, b)
        time.sleep(pause)

    def mkdir(path, mode=0o777, **kwargs):  # a read-only parent
        if os.path.dirname(path) == parent:
            raise PermissionError(13, "Permission denied", path)
        return real_mkdir(path, mode, **kwargs)

    os.rename = rename
    if mode == "two renames":
        atomic._exchange = lambda a, b: False
    if mode == "in place":
        os.mkdir = mkdir

    def save(folder):
        for name, content in files.items():
            path = os.path.join(folder, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)
            time.sleep(1.5 * pause)

    # The calls that change what is on disk (or end a write): the process
    # dies right before the `die_at`-th of them, or after the save if there
    # are no more. The disk only changes inside such calls, so dying before
    # each one reaches every state a kill at any moment can leave.
    CHANGING = {"open", "close", "__exit__", "mkdir", "rename", "replace",
                "unlink", "rmdir", "chmod", "fsync", "flock"}
    calls = 0

    def count(frame, event, function):
        global calls
        if event == "c_call" and function.__name__ in CHANGING:
            if calls == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            calls += 1

    print("go", flush=True)
    sys.setprofile(count)
    atomic.save_atomically(save, target)
    sys.setprofile(None)
    if calls == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    print(calls, flush=True)
    """
)


def run_child(script, target, mode, delay=None, die_at=-1):
    """Save `NEW` over `target` in a child process: killed from outside after
    `delay` seconds, or by itself before its `die_at`-th disk-changing call.
    Returns the number of such calls of a whole save (None if killed)."""
    process = subprocess.Popen(
        [sys.executable, "-S", "-W", "ignore", str(script), PACKAGE_DIR]
        + [str(target), mode, repr(NEW), str(die_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "go\n", process.stderr.read()
    if delay is not None:
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
    process.wait()
    calls, stderr = process.stdout.read(), process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert process.returncode in (0, -signal.SIGKILL), stderr
    return int(calls) if process.returncode == 0 else None


def killed_save_outcome(script, parent, mode, **kill):
    """Kill a save of `NEW` over `OLD` (with the user's files) as `kill`
    says; check what the target holds right after the kill and after
    `atomic.recover`. Returns `(right after the kill, after recovery)`:
    the first "old", "new", "missing" or "partial" (no `config.json`), the
    second "old" or "new"."""
    target = parent / "preset"
    old, new = {**OLD, **USER}, {**NEW, **USER}
    if parent.exists():
        shutil.rmtree(parent)
    write(target, old)
    run_child(script, target, mode, **kill)
    found = None
    if os.path.isdir(target):
        found = {
            name: content
            for name, content in snapshot(target).items()
            if name not in USER and ".autodist-" not in name
        }
    if found == OLD or found == NEW:
        right_after = "old" if found == OLD else "new"
    elif mode == "two renames":
        assert found is None, found
        right_after = "missing"
    elif mode == "in place":
        assert found is not None and "config.json" not in found, found
        right_after = "partial"
    else:
        raise AssertionError(f"neither old nor new: {found}")
    atomic.recover(target)
    after = snapshot(target)
    assert after in (old, new), after
    assert os.listdir(parent) == ["preset"]
    assert not [n for n in os.listdir(target) if n.startswith(".autodist-")]
    return right_after, "new" if after == new else "old"


def assert_sigkill_leaves_old_or_new(tmp_path, mode):
    """Kill a save at every point and at random times: the result is the old
    or the new preset.

    A child process saves `NEW` over `OLD` (plus the user's files). It dies
    right before each call of the save that changes the disk, in turn, and
    after the last one; then, 8 times, it is killed from outside with SIGKILL
    after a random delay (seeded) over the length of a slowed-down save.

    Right after the kill, before any recovery, the preset files in the target
    (the user's files may still be in the old folder moved aside):
    - "exchange" (Linux `renameat2`): the target is the complete old or the
      complete new preset.
    - "two renames" (no `renameat2`): the same, or no target at all if the
      kill fell between the two renames (some point does).
    - "in place" (read-only parent): the same, or a folder without
      `config.json` if the kill fell while the files were moved in (some
      point does).
    Then `atomic.recover(target)`, which every save runs first, must leave the
    complete old or the complete new preset, and nothing beside or inside it.
    """
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    parent = tmp_path / "parent"
    target = parent / "preset"

    write(target, {**OLD, **USER})
    start = time.monotonic()
    calls = run_child(script, target, mode)
    duration = time.monotonic() - start
    assert calls and snapshot(target) == {**NEW, **USER}

    outcomes = [
        killed_save_outcome(script, parent, mode, die_at=point)
        for point in range(calls + 1)
    ]
    assert outcomes[0] == ("old", "old") and outcomes[-1] == ("new", "new"), outcomes
    between = {"two renames": "missing", "in place": "partial"}.get(mode)
    if between:
        assert any(right_after == between for right_after, _ in outcomes), outcomes

    rng = random.Random(f"sigkill-{mode}")
    for _ in range(8):
        delay = rng.uniform(0, 1.2 * duration)
        killed_save_outcome(script, parent, mode, delay=delay)


def test_sigkill_at_random_points_leaves_old_or_new(tmp_path):
    """Linux `renameat2` exchanges the folders (the other two modes run in
    integration/test_saving_sigkill.py)."""
    assert_sigkill_leaves_old_or_new(tmp_path, "exchange")
