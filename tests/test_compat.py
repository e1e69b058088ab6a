"""Every private Keras/keras-hub touchpoint exists in the installed versions,
and no other module of the package reaches into `keras.src`/`keras_hub.src`."""

import pathlib
import re

from keras_hub_autodist import compat
from keras_hub_autodist.compat import state as compat_state

COMPAT = pathlib.Path(compat.__file__).parent
PACKAGE = COMPAT.parent


def _outside_compat(path: pathlib.Path) -> bool:
    """Whether `path` is a module outside the compat package, the only one
    that reaches into Keras."""
    return COMPAT not in path.parents


def test_every_touchpoint_exists_in_the_installed_keras_and_keras_hub():
    assert compat.check_touchpoints() == []
    assert set(compat_state.TOUCHPOINTS) <= set(compat.TOUCHPOINTS)


def test_a_traced_step_keeps_its_hoisted_constants_where_the_leak_check_reads():
    """`compat.leaked_tracers` reads `Traced._consts`, an attribute of each
    traced function rather than of a module, so `TOUCHPOINTS` can't name
    it: an upgrade of JAX that drops it would turn the check off silently.
    A leaked tracer is found there; a closed-over array sits there too."""
    import jax
    import jax.numpy as jnp

    closed = jnp.arange(3.0)
    traced = jax.jit(lambda x: x + closed).trace(jnp.ones(3))
    assert hasattr(traced, "_consts")
    assert compat.leaked_tracers(traced) == []
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x).trace(jnp.ones(3))
    traced = jax.jit(lambda x: x + leaked[0]).trace(jnp.ones(3))
    assert len(compat.leaked_tracers(traced)) == 1


def test_a_missing_touchpoint_is_named():
    original = compat.TOUCHPOINTS
    try:
        compat.TOUCHPOINTS = original + (("keras.src.saving.saving_lib", "Nope"),)
        assert compat.check_touchpoints() == [
            "keras.src.saving.saving_lib.Nope: no such attribute"
        ]
    finally:
        compat.TOUCHPOINTS = original


def test_only_compat_imports_private_modules():
    private = re.compile(r"^\s*(from|import)\s+(keras|keras_hub)\.src\b", re.M)
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if _outside_compat(path) and private.search(path.read_text())
    ]
    assert offenders == []


# `setattr(obj, NAME, ...)` / `object.__setattr__(obj, NAME, ...)` /
# `delattr(obj, NAME)`: the object and the attribute set.
_SETS = re.compile(r"(?:object\.__setattr__|setattr|delattr)\(\s*(\w+),\s*([^,)]+)")


def test_only_compat_replaces_attributes_of_keras_objects():
    """Outside the compat package the package sets only its own attributes: those of
    a frozen value it builds (`self`), or one named by an `*_ATTR` constant
    of its own. Everything else goes through `compat.PATCHES`."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if not _outside_compat(path):
            continue
        for match in _SETS.finditer(path.read_text()):
            obj, name = match.group(1), match.group(2).strip()
            if obj == "self" or re.fullmatch(r"_?[A-Z_]+_ATTR", name):
                continue
            offenders.append(f"{path.relative_to(PACKAGE)}: {match.group(0)}")
    assert offenders == []


def test_every_process_wide_patch_names_what_it_replaces():
    for patch in compat.PATCHES:
        assert patch.owner.startswith("keras_hub_autodist."), patch
        assert patch.lasts, patch
        if patch.process_wide:
            holder = compat._resolve(patch.holder)
            assert hasattr(holder, patch.attribute), patch


def test_patched_is_shared_by_threads_and_restored_on_error():
    import threading

    import keras

    original = keras.Variable.assign

    def replacement(previous):
        assert previous is original
        return lambda variable, value: previous(variable, value)

    inner_entered, outer_may_leave = threading.Event(), threading.Event()
    seen = []

    def other_thread():
        with compat.patched({"variable_assign": replacement}):
            seen.append(keras.Variable.assign)
            inner_entered.set()
            assert outer_may_leave.wait(timeout=30)

    with compat.patched({"variable_assign": replacement}):
        installed = keras.Variable.assign
        assert installed is not original
        thread = threading.Thread(target=other_thread)
        thread.start()
        assert inner_entered.wait(timeout=30)
        assert compat.installed_patches() == {"variable_assign": 2}
    # The other thread still holds it: the same installation stays.
    assert keras.Variable.assign is installed
    assert seen == [installed]
    outer_may_leave.set()
    thread.join(timeout=30)
    assert keras.Variable.assign is original
    assert compat.installed_patches() == {}

    try:
        with compat.patched({"variable_assign": replacement}):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert keras.Variable.assign is original
    assert compat.installed_patches() == {}


def test_an_unregistered_patch_is_refused():
    import pytest

    with pytest.raises(KeyError, match="not a registered process-wide patch"):
        with compat.patched({"nope": lambda original: None}):
            pass
    with pytest.raises(KeyError, match="not a registered instance patch"):
        compat.patch_instance("variable_assign", object(), "x", 1)
