"""What needs no model: `ResumableCheckpoint` checks its arguments when it is
made, fingerprints round trip, and a restore's error names what differs and
how to fix it (LoRA rank, another model, optimizer, dtype, batch size).

The restores and resumes of real models are in
integration/test_checkpoint_fingerprints.py and
integration/test_checkpoint_refusals.py.
"""

import os
import pathlib
import sys

import pytest

import keras_hub_autodist
from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint
from keras_hub_autodist import errors
from keras_hub_autodist.training import fingerprint
from keras_hub_autodist.training.fingerprint import Fingerprint
from keras_hub_autodist.training.fingerprint import Training

SOURCE = "The checkpoint 'ckpt/6'"
QUERY = "decoder_block_0/attention/query"
BASE = {
    "token_embedding/embeddings": ((100, 32), "float32"),
    f"{QUERY}/kernel": ((8, 32, 8), "float32"),
}


def lora(rank):
    return {
        f"{QUERY}/lora_kernel_a": ((8, 32, rank), "float32"),
        f"{QUERY}/lora_kernel_b": ((rank, 8), "float32"),
    }


def model(trainable, frozen=None, optimizer=None, optimizer_class="Adam"):
    variables = {
        fingerprint.TRAINABLE: trainable,
        fingerprint.NON_TRAINABLE: frozen or {},
        fingerprint.OPTIMIZER: optimizer or {},
    }
    return Fingerprint(variables, optimizer_class)


def error(saved, current, groups=fingerprint.WEIGHTS):
    found = fingerprint.mismatch_error(
        "The checkpoint 'ckpt/6'", saved, current, groups
    )
    assert found is not None
    assert isinstance(found, RestoreError)
    message = str(found)
    assert "The checkpoint 'ckpt/6' does not match the model" in message
    assert "Nothing was restored. Received:" in message
    return message


def test_a_lora_checkpoint_into_a_model_without_lora_names_lora_and_its_rank():
    message = error(model(lora(4), BASE), model(BASE))
    assert "the checkpoint holds 4 weights with LoRA of rank 4" in message
    assert "the model has 2 weights without LoRA" in message
    assert f"`{QUERY}/lora_kernel_a`: saved (8, 32, 4) float32, not in the model" in (
        message
    )
    assert f"`{QUERY}/kernel`: frozen (non-trainable) in the checkpoint" in message
    assert "call `backbone.enable_lora(4)` before restoring" in message


def test_another_lora_rank_names_both_ranks():
    message = error(model(lora(4), BASE), model(lora(2), BASE))
    assert (
        f"`{QUERY}/lora_kernel_a`: saved (8, 32, 4) float32, the model has "
        "(8, 32, 2) float32" in message
    )
    assert "call `backbone.enable_lora(4)` instead of `enable_lora(2)`" in message


def test_lora_in_the_model_only():
    message = error(model(BASE), model(lora(4), BASE))
    assert "holds no LoRA weights" in message
    assert "restore it into a model without `enable_lora`" in message


def test_another_model_is_named_before_lora():
    narrow = {p: ((s[0], 16, *s[2:]), d) for p, (s, d) in BASE.items()}
    message = error(model(lora(4), BASE), model(lora(4), narrow))
    assert (
        "`token_embedding/embeddings`: saved (100, 32) float32, the model has "
        "(100, 16) float32" in message
    )
    assert "another model" in message and "enable_lora" not in message


def test_other_dtypes_and_other_trainable_layers():
    half = {p: (s, "bfloat16") for p, (s, _) in BASE.items()}
    assert "other dtypes" in error(model(BASE), model(half))
    frozen = {"token_embedding/embeddings": BASE["token_embedding/embeddings"]}
    rest = {p: v for p, v in BASE.items() if p not in frozen}
    assert "freeze (`trainable = False`)" in error(model(BASE), model(rest, frozen))


def test_another_optimizer_is_named():
    slots = {"iteration": ((), "int32"), "x_momentum": ((2,), "float32")}
    saved = model(BASE, optimizer=slots)
    current = model(BASE, optimizer=slots, optimizer_class="AdamW")
    groups = (fingerprint.OPTIMIZER,)
    assert "trained with Adam: compile with `keras.optimizers.Adam`" in error(
        saved, current, groups
    )
    fewer = model(BASE, optimizer={"iteration": ((), "int32")})
    assert "`x_momentum`: saved (2,) float32, not in the model" in error(
        saved, fewer, groups
    )
    assert fingerprint.mismatch_error("x", saved, saved, fingerprint.GROUPS) is None


def test_another_batch_size_says_which_to_use():
    saved = Training(batch_size=2, steps_per_epoch=4)
    found = fingerprint.training_error("The checkpoint 'ckpt/3'", saved, Training(4, 2))
    message = str(found)
    assert "batch size 2, this run's 4 and 4 batches per epoch, this run's 2" in message
    assert "Use batch_size=2, as the interrupted run did" in message
    assert "Received: batch_size=4, 2 batches per epoch" in message
    two = fingerprint.training_error("c", Training(8, 4), Training(16, 4), processes=2)
    assert "Use batch_size=4 in each of 2 processes" in str(two)
    assert fingerprint.training_error("c", saved, Training(None, 4)) is None
    assert fingerprint.training_error("c", saved, Training(2, 4)) is None


def test_a_folder_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    from keras_hub_autodist.training import restore

    for step in ("3", "7"):
        (tmp_path / step).mkdir()  # empty: a copy that stopped early
    with pytest.raises(RestoreError) as raised:
        restore.restore_orbax(None, None, str(tmp_path))
    message = str(raised.value)
    assert "holds no complete Orbax checkpoint" in message
    assert f"{tmp_path / '7'}: its `pytree` can't be read" in message
    assert f"{tmp_path / '3'}: its `pytree` can't be read" in message


def test_a_fingerprint_round_trips_and_refuses_garbage():
    saved = fingerprint.Fingerprint(
        {"trainable_variables": {"a/kernel": ((2, 3), "float32")}},
        "Adam",
        fingerprint.Training(8, 4),
    )
    assert fingerprint.Fingerprint.from_json(saved.to_json()) == saved
    for text in ("{}", '{"format": "x"}', "[]"):
        with pytest.raises(ValueError):
            fingerprint.Fingerprint.from_json(text)


# --- ResumableCheckpoint's arguments ------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"max_to_keep": 0}, "max_to_keep=0"),
        ({"max_to_keep": -1}, "max_to_keep=-1"),
        ({"max_to_keep": "2"}, "max_to_keep='2'"),
        ({"max_to_keep": 2.0}, "max_to_keep=2.0"),
        ({"max_to_keep": True}, "max_to_keep=True"),
        ({"save_freq": 0}, "save_freq=0"),
        ({"save_freq": "epoch"}, "save_freq='epoch'"),
        ({"save_freq": 2.5}, "save_freq=2.5"),
        ({"save_on_background": "yes"}, "save_on_background='yes'"),
        ({"save_on_background": 1}, "save_on_background=1"),
        ({"save_on_sigterm": None}, "save_on_sigterm=None"),
        ({"time_limit": -5}, "time_limit=-5"),
        ({"time_limit": "1h"}, "time_limit='1h'"),
        ({"time_limit": float("nan")}, "time_limit=nan"),
        ({"stop_check_freq": 0}, "stop_check_freq=0"),
        ({"stop_check_freq": None}, "stop_check_freq=None"),
    ],
)
def test_bad_arguments_are_refused_at_construction(tmp_path, kwargs, named):
    with pytest.raises(errors.CheckpointOptionError) as raised:
        ResumableCheckpoint(str(tmp_path / "ckpt"), **kwargs)
    assert named in str(raised.value)
    assert isinstance(raised.value, keras_hub_autodist.AutodistError)
    assert not os.path.exists(tmp_path / "ckpt")


def test_a_directory_that_cant_hold_checkpoints_is_refused(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    one_checkpoint = tmp_path / "ckpt" / "4"
    (one_checkpoint / "pytree").mkdir(parents=True)
    cases = {
        str(a_file): "is a file, not a folder",
        str(a_file / "ckpt"): "is a file",
        "": "is empty",
        b"ckpt": "the path of a folder",
        3: "the path of a folder",
        str(one_checkpoint): "is one Orbax checkpoint",
    }
    for directory, why in cases.items():
        with pytest.raises(errors.CheckpointOptionError, match=why) as raised:
            ResumableCheckpoint(directory)
        assert "directory=" in str(raised.value)
    assert a_file.read_text() == "mine"
    ResumableCheckpoint(pathlib.Path(tmp_path / "new" / "ckpt"))  # made at save


def test_without_orbax_the_error_names_the_checkpoints_extra(tmp_path, monkeypatch):
    # As if orbax-checkpoint were not installed: `orbax` can't be imported.
    monkeypatch.setitem(sys.modules, "orbax", None)
    for name in [name for name in sys.modules if name.startswith("orbax.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(keras_hub_autodist.ExtraMissingError) as raised:
        ResumableCheckpoint(str(tmp_path / "checkpoints"), save_freq=1)
    assert "keras-hub-autodist[checkpoints]" in str(raised.value)
    assert isinstance(raised.value, ImportError)
    assert not (tmp_path / "checkpoints").exists()


def test_a_missing_compiler_is_a_missing_extra():
    assert issubclass(errors.CompilerMissingError, keras_hub_autodist.ExtraMissingError)
    assert issubclass(errors.CompilerMissingError, errors.PlanError)
