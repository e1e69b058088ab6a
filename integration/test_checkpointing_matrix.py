"""Checkpoints on other meshes and the refusals that need a trained model
(the fast cases are in tests/test_checkpointing.py)."""

import shutil

import keras
import pytest
from test_checkpointing import MESH
from test_checkpointing import OTHER_MESH
from test_checkpointing import assert_backup_and_restore_resumes
from test_checkpointing import assert_load_weights_restores_everything
from test_checkpointing import assert_no_mixed_sharding_warning
from test_checkpointing import assert_resumes_within_an_epoch
from test_checkpointing import assert_same_state
from test_checkpointing import bound
from test_checkpointing import fit
from test_checkpointing import orbax_run
from test_checkpointing import preset  # noqa: F401 (a fixture)
from test_checkpointing import state
from test_checkpointing import uninterrupted  # noqa: F401 (a fixture)

from keras_hub_autodist import RestoreError

pytestmark = pytest.mark.slow


def test_no_mixed_sharding_warning_on_a_2x4_mesh(preset):  # noqa: F811
    assert_no_mixed_sharding_warning(preset, MESH)


@pytest.mark.parametrize("mesh", ["same", "other"])
def test_resume_within_an_epoch(
    preset,  # noqa: F811
    tmp_path,
    uninterrupted,  # noqa: F811
    mesh,
):
    assert_resumes_within_an_epoch(preset, tmp_path, uninterrupted, mesh)


def test_load_weights_into_an_optimizer_the_user_built(preset, tmp_path):  # noqa: F811
    assert_load_weights_restores_everything(preset, tmp_path, "the user")


@pytest.mark.parametrize("mesh", ["same", "other"])
def test_backup_and_restore_resumes_a_bound_model(
    preset,  # noqa: F811
    tmp_path,
    uninterrupted,  # noqa: F811
    mesh,
):
    assert_backup_and_restore_resumes(preset, tmp_path, uninterrupted, mesh)


def test_keras_file_restores_on_another_mesh(preset, tmp_path):  # noqa: F811
    path = str(tmp_path / "run.keras")
    trained = bound(preset)
    fit(trained, preset)
    trained.save(path)
    other = bound(preset, OTHER_MESH)
    other.load_weights(path)
    assert_same_state(state(other), state(trained), atol=1e-6)


def test_another_optimizer_is_refused(preset, tmp_path):  # noqa: F811
    path = str(tmp_path / "adam.weights.h5")
    trained = bound(preset)
    fit(trained, preset)
    trained.save_weights(path)
    with pytest.raises(RestoreError, match="optimizer variables"):
        bound(preset, optimizer=keras.optimizers.SGD(0.1)).load_weights(path)


def test_orbax_load_weights_restores_optimizer_slots(preset, tmp_path):  # noqa: F811
    directory = str(tmp_path / "ckpt")
    trained = orbax_run(preset, directory, batches=3)
    for mesh in (MESH, OTHER_MESH):
        restored = bound(preset, mesh)  # optimizer not built yet
        restored.load_weights(directory)
        assert int(restored.optimizer.iterations) == 3
        assert_same_state(state(restored), state(trained), atol=1e-6)
        fit(restored, preset)


def test_a_checkpoint_being_written_is_never_picked(preset, tmp_path):  # noqa: F811
    directory = tmp_path / "ckpt"
    orbax_run(preset, str(directory), batches=2)
    # What a kill during the save of step 3 leaves behind.
    shutil.copytree(directory / "2", directory / "3.orbax-checkpoint-tmp-1234")
    lm = bound(preset)
    lm.load_weights(str(directory))
    assert int(lm.optimizer.iterations) == 2
