"""Sharded loads in several threads at once, and the patches they share.

The loading hooks are process-wide patches (`compat.PATCHES`): each thread's
load must get exactly keras-hub's weights whatever the other threads do, and
no patch may outlive the last load, when a load raises too.
"""

import threading

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

from keras_hub_autodist import compat
from keras_hub_autodist import loading

# Two loads meet at their first weight, then one finishes while the other is
# still loading: the first to finish must not take the hooks from the other.
MESHES = {
    "same": ({"batch": 2, "model": 4}, {"batch": 2, "model": 4}),
    "other": ({"batch": 2, "model": 4}, {"batch": 1, "model": 8}),
}


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("threads") / "gemma",
        keras_hub.models.GemmaBackbone,
        {**tiny_presets.GEMMA_MQA, "dtype": "float32"},
    )


@pytest.fixture(scope="module")
def reference(preset):
    backbone = keras_hub.models.Backbone.from_preset(preset)
    return {v.path: np.asarray(v.value) for v in backbone.weights}


def overlapping_loads(monkeypatch, preset, meshes, fail_second=False):
    """Load `preset` on each mesh in its own thread: all of them wait for
    each other at their first weight, then the first thread finishes while
    the others wait for it before going on."""
    ready = threading.Barrier(len(meshes))
    first_done = threading.Event()
    put = loading._Session.put
    seen = set()

    def meeting_put(session, source, variable):
        me = threading.current_thread().name
        if me not in seen:
            seen.add(me)
            ready.wait(timeout=60)
            if me != "load-0":
                assert first_done.wait(timeout=120)
        if fail_second and me != "load-0":
            raise OSError("disk vanished")
        return put(session, source, variable)

    monkeypatch.setattr(loading._Session, "put", meeting_put)
    results, errors = {}, {}

    def load(index, mesh):
        try:
            results[index] = keras_hub.models.Backbone.from_preset(
                preset, device_mesh=mesh
            )
        except Exception as error:  # reported by the test
            errors[index] = error
        finally:
            if index == 0:
                first_done.set()

    threads = [
        threading.Thread(target=load, args=(i, mesh), name=f"load-{i}")
        for i, mesh in enumerate(meshes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results, errors


@pytest.mark.parametrize("meshes", MESHES.values(), ids=MESHES.keys())
def test_loads_in_threads_each_load_keras_hubs_weights(
    monkeypatch, preset, reference, meshes
):
    results, errors = overlapping_loads(monkeypatch, preset, meshes)
    assert errors == {}
    assert sorted(results) == list(range(len(meshes)))
    for index, backbone in results.items():
        expected = meshes[index]
        assert (
            dict(
                zip(
                    backbone.weights[0].value.sharding.mesh.axis_names,
                    backbone.weights[0].value.sharding.mesh.devices.shape,
                )
            )
            == expected
        )
        for variable in backbone.weights:
            np.testing.assert_array_equal(
                np.asarray(variable.value), reference[variable.path], variable.path
            )
    assert compat.installed_patches() == {}
    assert keras.Variable.assign is loading._original_assign


def test_no_hook_outlives_loads_when_one_raises(monkeypatch, preset, reference):
    before = dict(vars(keras.Variable))
    results, errors = overlapping_loads(
        monkeypatch, preset, MESHES["other"], fail_second=True
    )
    assert list(results) == [0]
    assert isinstance(errors[1], OSError)
    assert str(errors[1]) == "disk vanished"
    for variable in results[0].weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), reference[variable.path]
        )
    assert compat.installed_patches() == {}
    assert dict(vars(keras.Variable)) == before


def test_a_thread_without_a_load_is_left_to_keras(monkeypatch, preset):
    """While another thread loads, this thread's variables behave as Keras'
    own: assigned whole, initialised with their initializer."""
    inside = threading.Event()
    leave = threading.Event()
    put = loading._Session.put

    def waiting_put(session, source, variable):
        inside.set()
        assert leave.wait(timeout=120)
        return put(session, source, variable)

    monkeypatch.setattr(loading._Session, "put", waiting_put)
    loader = threading.Thread(
        target=keras_hub.models.Backbone.from_preset,
        args=(preset,),
        kwargs={"device_mesh": {"batch": 2, "model": 4}},
    )
    loader.start()
    try:
        assert inside.wait(timeout=120)
        assert "variable_assign" in compat.installed_patches()
        variable = keras.Variable(np.zeros((2, 3), "float32"))
        variable.assign(np.ones((2, 3), "float32"))
        np.testing.assert_array_equal(np.asarray(variable.value), np.ones((2, 3)))
        assert loading.active_sessions() == 0
    finally:
        leave.set()
        loader.join(timeout=300)
    assert compat.installed_patches() == {}
