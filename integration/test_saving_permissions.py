"""Saves by a user who may not create files everywhere, as keras-hub's own
save allows them or with one clear error that names the folder asked for.

The tests run as root, whom permissions do not stop, so each save runs in a
child process as `nobody` (through `setpriv`), importing only the saving
module (no Keras), with a fake save writing `test_saving.NEW`.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
from test_saving import NEW
from test_saving import OLD
from test_saving import USER_FILES
from test_saving import snapshot
from test_saving import write

from keras_hub_autodist import saving

pytestmark = pytest.mark.slow

PACKAGE_DIR = os.path.dirname(saving.__file__)
NOBODY = 65534
CHILD = textwrap.dedent(
    """
    import json, os, sys, types, warnings

    package = types.ModuleType("keras_hub_autodist")
    package.__path__ = [sys.argv[1]]
    sys.modules["keras_hub_autodist"] = package
    from keras_hub_autodist import saving

    target, files = sys.argv[2], json.loads(sys.argv[3])

    def save(folder):
        for name, content in files.items():
            path = os.path.join(folder, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(content)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            saving.save_atomically(save, target)
            outcome = {"error": None}
        except Exception as error:
            outcome = {
                "error": type(error).__name__,
                "permission": isinstance(error, PermissionError),
                "message": str(error),
            }
    outcome["warnings"] = [str(w.message) for w in caught]
    print(json.dumps(outcome))
    """
)


def as_user(command):
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user to save as")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] + (
        command
    )


@pytest.fixture
def place():
    """A folder the saving user owns, readable by all."""
    folder = tempfile.mkdtemp(prefix="autodist-permissions-")
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        for root, dirs, _ in os.walk(folder):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
        shutil.rmtree(folder)


def give(path, uid=NOBODY):
    """`path` and everything below it to `uid` (as root), files writable."""
    if os.geteuid() != 0:
        return
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid)
            if name in files:
                os.chmod(os.path.join(root, name), 0o666)


def readable_copy_of_the_package(place):
    """The package's sources copied into `place`, readable by every user: the
    checkout itself may sit in a folder only its owner can enter (CI clones
    into a 0700 temporary folder)."""
    copy = os.path.join(place, "package")
    if not os.path.exists(copy):
        shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for root, _, files in os.walk(copy):
            os.chmod(root, 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)
    return copy


def save_as_user(target, files=NEW):
    place = os.path.dirname(os.path.dirname(target))
    script = os.path.join(place, "child.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(CHILD)
        os.chmod(script, 0o644)
    package = readable_copy_of_the_package(place)
    done = subprocess.run(
        as_user([sys.executable, "-S", script, package, target, json.dumps(files)]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def user_tree(place, preset_mode=0o555, parent_mode=0o755):
    """`place/parent/preset`: an old preset with the user's files, owned by
    the saving user; the preset folder not writable (its files are)."""
    parent = os.path.join(place, "parent")
    target = os.path.join(parent, "preset")
    write(target, {**OLD, **USER_FILES})
    give(parent)
    os.chmod(target, preset_mode)
    os.chmod(parent, parent_mode)
    return parent, target


def test_a_read_only_preset_folder_of_the_user_is_saved_into(place):
    """keras-hub's save overwrites the files of a 0o555 folder: so does this
    one, swapping the new folder in; the folder keeps its mode."""
    parent, target = user_tree(place)
    outcome = save_as_user(target)
    assert outcome["error"] is None, outcome
    assert mode(target) == 0o555
    assert snapshot(target) == {**NEW, **USER_FILES}
    assert os.listdir(parent) == ["preset"]


def test_read_only_folders_inside_the_old_preset_keep_their_files(place):
    parent, target = user_tree(place, preset_mode=0o755)
    os.chmod(os.path.join(target, "assets", "mine"), 0o555)
    os.chmod(os.path.join(target, "assets"), 0o555)
    outcome = save_as_user(target)
    assert outcome["error"] is None, outcome
    assert snapshot(target) == {**NEW, **USER_FILES}
    assert mode(os.path.join(target, "assets", "mine")) == 0o555
    assert os.listdir(parent) == ["preset"]


def test_a_read_only_preset_in_a_read_only_folder_is_saved_in_place(place):
    parent, target = user_tree(place, parent_mode=0o555)
    outcome = save_as_user(target)
    assert outcome["error"] is None, outcome
    assert any("in place" in w for w in outcome["warnings"]), outcome
    assert mode(target) == 0o555
    assert snapshot(target) == {**NEW, **USER_FILES}
    assert os.listdir(parent) == ["preset"]


def test_a_folder_that_cant_be_created_is_named(place):
    parent = os.path.join(place, "parent")
    os.makedirs(parent)
    give(parent)
    os.chmod(parent, 0o555)
    target = os.path.join(parent, "preset")
    outcome = save_as_user(target)
    assert outcome["error"] == "SavePermissionError" and outcome["permission"]
    assert f"into {target!r}" in outcome["message"]
    assert ".saving-" not in outcome["message"]
    assert os.listdir(parent) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a folder of another user")
def test_a_read_only_preset_folder_of_another_user_is_refused_whole(place):
    """Its files can be overwritten, but not replaced atomically, nor its
    old files of the format removed: refused before anything is written."""
    parent, target = user_tree(place)
    os.chown(target, 0, 0)
    before = snapshot(target)
    outcome = save_as_user(target)
    assert outcome["error"] == "SavePermissionError" and outcome["permission"]
    assert f"into {target!r}" in outcome["message"]
    assert "owned by user 0" in outcome["message"]
    assert ".saving-" not in outcome["message"]
    assert snapshot(target) == before
    assert os.listdir(parent) == ["preset"]
