"""A checkpoint belongs to its model: a restore of another model, another LoRA
rank or another optimizer is refused, whole, with what differs and how to fix
it; damaged newest checkpoints are skipped.

Nothing here trains: the checkpoints are written from built optimizer state
(`ResumableCheckpoint` saving outside `fit`, `save_weights`, `save`). The
cases that train and resume are in test_checkpoint_refusals.py; the checks
that need no model in tests/test_checkpoint_options.py.
"""

import glob
import os
import shutil
import warnings

import h5py
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint
from keras_hub_autodist import compat
from keras_hub_autodist.training import fingerprint
from keras_hub_autodist.training import weights_files

pytestmark = pytest.mark.slow

MESH = {"batch": 2, "model": 4}
ROWS = 8
BATCH = 2


@pytest.fixture(scope="module")
def wide(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]  # hidden_dim 32


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    config = {**tiny_presets.GEMMA_MQA, "hidden_dim": 16}
    return tiny_presets.gemma_preset(tmp_path_factory.mktemp("narrow"), config)


def bound(preset, lora=None, optimizer="adam", compiled=True, mesh=MESH):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    if lora:
        lm.backbone.enable_lora(lora)
    if compiled:
        lm.compile(
            optimizer=keras.optimizers.get(optimizer),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return lm


def with_state(lm, iterations=3, metrics=False):
    """Give the optimizer slots and an iteration count (and, with `metrics`,
    the metrics `fit` builds), as training would."""
    if metrics:
        compat.symbolic_build(lm, data(lm.backbone.vocabulary_size))
    lm.optimizer.build(lm.trainable_variables)
    lm.optimizer.iterations.assign(iterations)
    for variable in lm.optimizer.variables[2:]:
        variable.assign(np.full(variable.shape, 0.5, variable.dtype))
    return lm


def orbax_checkpoint(lm, directory, steps=1):
    """Write `steps` checkpoints of `lm` into `directory`, as
    `ResumableCheckpoint` does after each batch."""
    checkpoint = ResumableCheckpoint(
        directory, save_freq=1, max_to_keep=None, save_on_background=False
    )
    checkpoint.set_model(lm)
    for batch in range(steps):
        checkpoint.on_train_batch_end(batch)
    checkpoint.on_train_end()
    return directory


def data(vocabulary_size):
    x = tiny_presets.token_batch(ROWS, vocabulary_size)
    return x, np.roll(x["token_ids"], -1, axis=1)


def fit_resuming(lm, directory, epochs=1, **kwargs):
    x, y = data(lm.backbone.vocabulary_size)
    checkpoint = ResumableCheckpoint(directory, save_freq=1)
    history = lm.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint],
        **kwargs,
    )
    return checkpoint, history


def weights(lm):
    return {w.path: np.asarray(w.value) for w in lm.weights}


def assert_unchanged(lm, before):
    for path, value in before.items():
        np.testing.assert_array_equal(weights(lm)[path], value)


@pytest.fixture(scope="module")
def wide_checkpoint(wide, tmp_path_factory):
    """Checkpoints of the hidden-32 model at steps 4 and 5."""
    directory = str(tmp_path_factory.mktemp("wide") / "ckpt")
    return orbax_checkpoint(with_state(bound(wide), metrics=True), directory, 2)


@pytest.fixture(scope="module")
def lora_checkpoint(wide, tmp_path_factory):
    """A checkpoint of the hidden-32 model with LoRA of rank 4."""
    directory = str(tmp_path_factory.mktemp("lora") / "ckpt")
    return orbax_checkpoint(with_state(bound(wide, lora=4)), directory)


# --- Another model: other shapes -------------------------------------------------


def test_resume_refuses_a_checkpoint_of_another_model(narrow, wide_checkpoint):
    lm = bound(narrow)
    before = weights(lm)
    with pytest.raises(RestoreError) as raised:
        fit_resuming(lm, wide_checkpoint)
    message = str(raised.value)
    vocabulary = lm.backbone.vocabulary_size
    assert (
        f"`token_embedding/embeddings`: saved ({vocabulary}, 32) float32, "
        f"the model has ({vocabulary}, 16) float32" in message
    )
    assert "another model" in message and "Received:" in message
    assert int(lm.optimizer.iterations) == 0  # not the other run's count
    assert_unchanged(lm, before)
    with pytest.raises(RestoreError, match="another model"):
        lm.load_weights(wide_checkpoint)
    assert_unchanged(lm, before)


def test_weights_files_of_another_model_are_refused(wide, narrow, tmp_path):
    trained = with_state(bound(wide))
    lm = bound(narrow)
    before = weights(lm)
    for kind in ("weights.h5", "keras", "weights.json"):
        path = str(tmp_path / f"wide.{kind}")
        if kind == "keras":
            trained.save(path)
        else:
            shard = 1 if kind == "weights.json" else None
            trained.save_weights(path, max_shard_size=shard)
        with pytest.raises(RestoreError) as raised:
            lm.load_weights(path)
        message = str(raised.value)
        assert "(token_embedding/embeddings)" in message, message
        assert ", 32) float32, the model has (" in message
        assert "another model" in message
        assert_unchanged(lm, before)


def test_plain_keras_files_are_checked_by_their_contents(wide, narrow, tmp_path):
    # Written without keras-hub-autodist: no fingerprint in the file.
    plain = keras_hub.models.CausalLM.from_preset(wide, preprocessor=None)
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    with h5py.File(path) as f:
        assert fingerprint.STORED_NAME not in f
    with pytest.raises(RestoreError, match=r"saved \(\d+, 32\) float32"):
        bound(narrow).load_weights(path)
    bound(wide).load_weights(path)  # the same model loads


def test_a_plain_orbax_checkpoint_is_checked_by_its_metadata(wide, narrow, tmp_path):
    # Keras' own OrbaxCheckpoint: no fingerprint, no random state.
    plain = keras_hub.models.CausalLM.from_preset(wide, preprocessor=None)
    plain.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with_state(plain)
    directory = str(tmp_path / "plain")
    checkpoint = keras.callbacks.OrbaxCheckpoint(
        directory, save_freq=1, save_on_background=False
    )
    checkpoint.set_model(plain)
    checkpoint.on_train_batch_end(0)
    checkpoint.on_train_end()
    with pytest.raises(RestoreError, match=r"saved \(\d+, 32\) float32"):
        bound(narrow).load_weights(directory)
    lm = bound(wide)
    lm.load_weights(directory)
    assert int(lm.optimizer.iterations) == 3


# --- LoRA -------------------------------------------------------------------------


def test_another_lora_rank_is_refused(wide, lora_checkpoint):
    lm = bound(wide, lora=2)
    with pytest.raises(RestoreError) as raised:
        fit_resuming(lm, lora_checkpoint)
    message = str(raised.value)
    assert "call `backbone.enable_lora(4)` instead of `enable_lora(2)`" in message
    assert "lora_kernel_a`: saved (8, 32, 4) float32, the model has (8, 32, 2)" in (
        message
    )
    assert int(lm.optimizer.iterations) == 0
    with pytest.raises(RestoreError, match=r"enable_lora\(4\)"):
        lm.load_weights(lora_checkpoint)


def test_a_lora_checkpoint_into_a_model_without_lora_names_lora(wide, lora_checkpoint):
    # docs/checkpointing.md, "Move to another mesh", with a LoRA run.
    lm = bound(wide)
    with pytest.raises(RestoreError) as raised:
        lm.load_weights(lora_checkpoint)
    message = str(raised.value)
    assert "a LoRA run of rank 4" in message
    assert "call `backbone.enable_lora(4)` before restoring" in message
    assert "Compile with the optimizer" not in message
    lm = bound(wide, lora=4)
    lm.load_weights(lora_checkpoint)  # the fix works
    assert int(lm.optimizer.iterations) == 3


def test_a_model_with_lora_refuses_a_checkpoint_without(wide, wide_checkpoint):
    with pytest.raises(RestoreError, match="holds no LoRA weights"):
        bound(wide, lora=4).load_weights(wide_checkpoint)


def test_lora_training_does_not_resume_from_a_weights_file(wide, tmp_path):
    # Keras merges LoRA kernels into the kernels of a weights file and zeroes
    # them on load: the optimizer state of the LoRA kernels has nothing left.
    path = str(tmp_path / "lora.weights.h5")
    with_state(bound(wide, lora=4)).save_weights(path)
    with pytest.raises(RestoreError, match="merged") as raised:
        bound(wide, lora=4).load_weights(path)
    assert "a LoRA run of rank 4" in str(raised.value)
    with pytest.raises(RestoreError, match="a LoRA run of rank 4"):
        bound(wide).load_weights(path)
    # The merged weights, as Keras' loader gives them when asked to.
    lm = bound(wide)
    lm.load_weights(path, skip_mismatch=True)
    plain = keras_hub.models.CausalLM.from_preset(wide, preprocessor=None)
    plain.load_weights(path, skip_mismatch=True)
    for name, value in weights(plain).items():
        np.testing.assert_allclose(weights(lm)[name], value, atol=1e-6)


# --- Optimizer --------------------------------------------------------------------


def test_another_optimizer_class_is_refused(wide, wide_checkpoint, tmp_path):
    # AdamW's variables have the paths and shapes of Adam's.
    lm = bound(wide, optimizer="adamw")
    with pytest.raises(RestoreError, match=r"trained with Adam: compile with"):
        lm.load_weights(wide_checkpoint)
    path = str(tmp_path / "adam.weights.h5")
    with_state(bound(wide)).save_weights(path)
    with pytest.raises(RestoreError, match=r"trained with Adam: compile with"):
        bound(wide, optimizer="adamw").load_weights(path)


# --- What a checkpoint records ------------------------------------------------------


def test_every_checkpoint_records_its_fingerprint(wide, lora_checkpoint, tmp_path):
    lm = with_state(bound(wide, lora=4))
    lm.save_weights(str(tmp_path / "run.weights.h5"))
    lm.save(str(tmp_path / "run.keras"))
    with h5py.File(tmp_path / "run.weights.h5") as f:
        from_h5 = fingerprint.Fingerprint.from_json(f[fingerprint.STORED_NAME][()])
    assert from_h5 == fingerprint.of_model(lm)
    path = "decoder_block_0/attention/query/lora_kernel_a"
    assert from_h5.group("trainable_variables")[path] == ((8, 32, 4), "float32")
    slot = "decoder_block_0_attention_query_lora_kernel_a_momentum"
    assert from_h5.group("optimizer_variables")[slot] == ((8, 32, 4), "float32")
    assert from_h5.optimizer == "Adam" and from_h5.lora_rank() == 4
    read = weights_files.read_weights_file
    assert read(str(tmp_path / "run.keras")).fingerprint == from_h5
    (step,) = os.listdir(lora_checkpoint)
    stored = os.path.join(lora_checkpoint, step, fingerprint.STORED_NAME)
    assert os.path.isdir(stored)
    # Keras' own loader reads a file that holds one.
    plain = keras_hub.models.CausalLM.from_preset(wide, preprocessor=None)
    bound(wide).save_weights(str(tmp_path / "plain.weights.h5"))
    plain.load_weights(str(tmp_path / "plain.weights.h5"))


def test_a_mesh_is_not_part_of_a_fingerprint(wide):
    lm = with_state(bound(wide))
    other = with_state(bound(wide, mesh={"batch": 4, "model": 2}))
    assert fingerprint.of_model(lm) == fingerprint.of_model(other)


# --- Damaged checkpoints ------------------------------------------------------------


def damage_empty(step):
    shutil.rmtree(step)
    os.makedirs(step)


def damage_no_pytree(step):
    shutil.rmtree(os.path.join(step, "pytree"))


def damage_truncated(step):
    for name in glob.glob(os.path.join(step, "pytree", "**", "d", "*"), recursive=True):
        with open(name, "r+b") as f:
            f.truncate(os.path.getsize(name) // 2)


@pytest.mark.parametrize("damage", [damage_empty, damage_no_pytree, damage_truncated])
def test_a_damaged_newest_checkpoint_falls_back(
    wide, wide_checkpoint, tmp_path, damage
):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(wide_checkpoint, directory)
    assert sorted(os.listdir(directory)) == ["4", "5"]
    damage(os.path.join(directory, "5"))
    lm = bound(wide)
    with pytest.warns(UserWarning, match=r"Skipped the damaged newest .*\b5\b.*step 4"):
        lm.load_weights(directory)
    assert int(lm.optimizer.iterations) == 3  # step 4 was saved at 3 batches
    assert sorted(os.listdir(directory)) == ["4", "5"]  # a restore moves nothing
    with pytest.raises(RestoreError, match="not a complete Orbax checkpoint"):
        bound(wide).load_weights(os.path.join(directory, "5"))


def test_no_complete_checkpoint_is_a_clear_error(wide, wide_checkpoint, tmp_path):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(wide_checkpoint, directory)
    for step in ("4", "5"):
        damage_no_pytree(os.path.join(directory, step))
    lm = bound(wide)
    with pytest.raises(RestoreError, match=r"holds no complete Orbax checkpoint: .*4"):
        lm.load_weights(directory)
    with pytest.raises(RestoreError, match="holds no complete"):
        fit_resuming(lm, directory)


def test_resume_skips_a_damaged_newest_checkpoint_and_moves_it_aside(
    wide, wide_checkpoint, tmp_path
):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(wide_checkpoint, directory)
    damage_empty(os.path.join(directory, "5"))
    lm = bound(wide)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The checkpoint holds 3 batches done: with 3 batches per epoch and
        # 1 epoch, training is complete and nothing is trained.
        checkpoint, _ = fit_resuming(lm, directory, steps_per_epoch=3)
    messages = [str(w.message) for w in caught]
    assert any("Skipped the damaged newest checkpoint(s) 5" in m for m in messages)
    assert any("renamed to 5.damaged" in m for m in messages)
    assert checkpoint.resumed_from == os.path.join(directory, "4")
    assert sorted(os.listdir(directory)) == ["4", "5.damaged"]
