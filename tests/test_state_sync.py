"""After each step a bound model puts the step's state back on its
variables without checking again a layout already checked
(`compat.steps.layout_checked_state_sync`): the values are the step's, a
value of another sharding is laid out as the variable's layout says, and
the check runs once per variable, not once per step."""

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_hub_autodist.compat import steps as compat_steps

MESH = {"batch": 2, "model": 4}


@pytest.fixture
def bound_lm(tiny_presets_dir):
    import keras_hub

    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh=MESH
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    return lm


def _batch(lm):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, lm.backbone.vocabulary_size, (4, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, 1, 1)


def test_the_variables_hold_the_steps_state(bound_lm, monkeypatch):
    x, y = _batch(bound_lm)
    returned = []
    bound_lm.make_train_function()
    step = bound_lm.train_function

    def recording(state, data):
        logs, state = step(state, data)
        returned.append(state)
        return logs, state

    monkeypatch.setattr(bound_lm, "train_function", recording)
    for _ in range(2):
        bound_lm.train_on_batch(x, y)
    trainable, non_trainable, optimizer, metrics = returned[-1]
    groups = [
        (bound_lm.trainable_variables, trainable),
        (bound_lm.non_trainable_variables, non_trainable),
        (bound_lm.optimizer.variables, optimizer),
        (bound_lm.metrics_variables, metrics),
    ]
    for variables, values in groups:
        for variable, value in zip(variables, values):
            assert variable.value is value, variable.path


def test_the_layout_is_checked_once_per_variable(bound_lm, monkeypatch):
    x, y = _batch(bound_lm)
    bound_lm.train_on_batch(x, y)  # checks every variable's layout once
    checks, syncing = [], []
    assign, sync = keras.Variable.assign, bound_lm.jax_state_sync

    def counting(variable, value):
        if syncing:
            checks.append(variable.path)
        return assign(variable, value)

    def counted_sync():
        syncing.append(True)
        try:
            return sync()
        finally:
            syncing.clear()

    monkeypatch.setattr(keras.Variable, "assign", counting)
    monkeypatch.setattr(bound_lm, "jax_state_sync", counted_sync)
    bound_lm.train_on_batch(x, y)
    assert checks == []
    # Keras' own sync assigns (and checks) every variable.
    keras_sync = type(bound_lm).jax_state_sync.__get__(bound_lm)
    monkeypatch.setattr(bound_lm, "jax_state_sync", keras_sync)
    syncing.append(True)
    bound_lm.train_on_batch(x, y)
    assert len(checks) >= len(bound_lm.trainable_variables)


def test_a_value_of_another_sharding_gets_the_variables_layout(bound_lm):
    x, y = _batch(bound_lm)
    bound_lm.train_on_batch(x, y)
    variable = bound_lm.backbone.token_embedding.embeddings
    expected = variable.value.sharding
    mesh = expected.mesh
    replicated = jax.device_put(
        np.asarray(variable.value), NamedSharding(mesh, PartitionSpec())
    )
    sync = compat_steps.layout_checked_state_sync(bound_lm)
    values = [v.value for v in bound_lm.trainable_variables]
    index = [v.path for v in bound_lm.trainable_variables].index(variable.path)
    values[index] = replicated
    bound_lm._jax_state = {"trainable_variables": values}
    bound_lm._jax_state_synced = False
    sync()
    assert variable.value.sharding.is_equivalent_to(expected, 2)
    assert not variable.value.sharding.is_equivalent_to(replicated.sharding, 2)
    np.testing.assert_array_equal(np.asarray(variable.value), np.asarray(replicated))


def test_a_one_device_mesh_compiles_each_step_once(tiny_presets_dir, monkeypatch):
    # Keras resets the metrics before each epoch, each on one device where
    # the mesh has one; the step returns them on the mesh. A step called
    # with both traced and compiled twice in the first epoch of two batches.
    import keras_hub

    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"],
        preprocessor=None,
        device_mesh=keras.distribution.DeviceMesh(
            (1, 1), ("batch", "model"), jax.devices()[:1]
        ),
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    traced = {"train_step": 0, "test_step": 0}
    for name in traced:
        step = getattr(lm, name)

        def counting(*args, step=step, name=name):
            traced[name] += 1  # the step's Python runs as it is traced
            return step(*args)

        monkeypatch.setattr(lm, name, counting)
    x, y = _batch(lm)
    for rows in (1, 4, 4):
        lm.fit(x, y, batch_size=1, steps_per_epoch=rows, epochs=2, verbose=0)
        lm.evaluate(x, y, batch_size=1, steps=rows, verbose=0)
    assert traced == {"train_step": 1, "test_step": 1}
    for variable in lm.metrics_variables + lm.optimizer.variables:
        assert isinstance(variable.value.sharding, NamedSharding), variable.path
