"""Mixed precision everywhere a checkpoint goes: fingerprints, Orbax
restores and `.weights.h5` files of a wrapped optimizer (`compile` puts a
`LossScaleOptimizer` around the optimizer under `mixed_float16`) are as
exact as float32's; and a learning-rate schedule is not optimizer state.
(The Orbax cases and `mixed_bfloat16`: integration/test_mixed_precision_matrix.py.)"""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

from keras_hub_autodist.training import fingerprint as fingerprints
from keras_hub_autodist.training.optimizer_state import optimizer_chain
from keras_hub_autodist.training.optimizer_state import optimizer_keys

MESH = {"batch": 2, "model": 4}
BATCH = 8
ROWS = 32  # 4 batches per epoch
POLICIES = ["mixed_float16", "mixed_bfloat16"]


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def data(preset):
    x = tiny_presets.token_batch(ROWS, 48)
    return x, np.roll(x["token_ids"], -1, axis=1)


def bound(preset, dtype, learning_rate=1e-2):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH, dtype=dtype
    )
    lm.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def fit(lm, preset, epochs=1, callbacks=()):
    x, y = data(preset)
    lm.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
           callbacks=list(callbacks))  # fmt: skip


def state(lm):
    """Every weight and every optimizer value of the whole optimizer chain,
    by the optimizer's place in it and the variable's name. (Under
    `mixed_float16` the first steps' float16 gradients overflow: the loss
    scale optimizer halves its scale and skips them, so its scale, not the
    iteration count, is what a fresh optimizer differs in.)"""
    found = {w.path: np.asarray(w.value) for w in lm.weights}
    for place, optimizer in optimizer_chain(lm.optimizer):
        for variable in optimizer.variables:
            name = variable.path.split("/", 1)[1]
            found[f"{place or 'outer'}/{name}"] = np.asarray(variable.value)
    return found


def assert_same_state(actual, expected):
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(actual[path], value, err_msg=path)


def test_optimizer_keys_are_unique_inside_a_wrapper():
    keys = optimizer_keys(
        ["loss_scale_optimizer_3/iteration", "loss_scale_optimizer_3/learning_rate",
         "adam_7/iteration", "adam_7/learning_rate", "adam_7/x_momentum"]
    )  # fmt: skip
    assert sorted(keys.values()) == [
        "adam/iteration",
        "adam/learning_rate",
        "adam/x_momentum",
        "loss_scale_optimizer/iteration",
        "loss_scale_optimizer/learning_rate",
    ]
    # Two owners Keras names alike keep their numbers rather than collide.
    same = optimizer_keys(["adam_1/iteration", "adam_2/iteration"])
    assert len(set(same.values())) == 2


def assert_fingerprint_keeps_every_optimizer_variable(lm):
    group = fingerprints.of_model(lm).group(fingerprints.OPTIMIZER)
    assert len(group) == len(lm.optimizer.variables)
    live = fingerprints.live_variables(lm)[fingerprints.OPTIMIZER]
    assert {id(v) for v in live.values()} == {id(v) for v in lm.optimizer.variables}
    if type(lm.optimizer).__name__ == "LossScaleOptimizer":
        assert {"loss_scale_optimizer/iteration", "adam/iteration"} <= set(group)


def assert_weights_file_restores_the_whole_chain(preset, dtype, tmp_path):
    path = str(tmp_path / "run.weights.h5")
    reference = bound(preset, dtype)
    fit(reference, preset)
    assert_fingerprint_keeps_every_optimizer_variable(reference)
    reference.save_weights(path)
    saved = state(reference)
    resumed = bound(preset, dtype)
    resumed.load_weights(path)
    assert_same_state(state(resumed), saved)


def test_a_mixed_float16_weights_file_restores_the_whole_chain(preset, tmp_path):
    assert_weights_file_restores_the_whole_chain(preset, "mixed_float16", tmp_path)


def test_a_resume_may_change_the_learning_rate_schedule():
    saved = fingerprints.Fingerprint(
        {fingerprints.OPTIMIZER: {"iteration": ((), "int32"),
                                  "learning_rate": ((), "float32"),
                                  "x_momentum": ((2,), "float32")}},
        optimizer="Adam",
    )  # fmt: skip
    schedule = fingerprints.Fingerprint(
        {fingerprints.OPTIMIZER: {"iteration": ((), "int32"),
                                  "x_momentum": ((2,), "float32")}},
        optimizer="Adam",
    )  # fmt: skip
    for before, after in [(saved, schedule), (schedule, saved)]:
        assert (
            fingerprints.mismatch_error("ckpt", before, after, [fingerprints.OPTIMIZER])
            is None
        )
    # Slots stay exact: a missing one is still refused.
    fewer = fingerprints.Fingerprint(
        {fingerprints.OPTIMIZER: {"iteration": ((), "int32")}}, optimizer="Adam"
    )
    assert (
        fingerprints.mismatch_error("ckpt", saved, fewer, [fingerprints.OPTIMIZER])
        is not None
    )
