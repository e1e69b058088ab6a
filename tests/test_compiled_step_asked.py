"""The compiled step is the step the user asked for: its dtype policy
(mixed precision included), its mesh (`--mesh auto --devices N` on a
machine without an accelerator) and its target (`device=` beside a
`device_mesh=`)."""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.compiled_step import compiled_memory

HAS_TPU_COMPILER = importlib.util.find_spec("libtpu") is not None
BATCH, SEQ = 4, 16


def _mesh(shape):
    devices = keras.distribution.list_devices()[: int(np.prod(shape))]
    return keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_mixed_precision_plan_compiles_its_own_step(tiny_presets_dir, policy):
    preset = tiny_presets_dir["gemma_mqa"]
    mesh = {"batch": 2, "model": 2}
    mixed = keras_hub_autodist.plan(preset, mesh, dtype=policy)
    full = keras_hub_autodist.plan(preset, mesh, dtype="float32")
    assert mixed.mixed_policy == policy and mixed.dtype == "float32"
    assert full.mixed_policy == ""
    # The same float32 variables, computed in 16 bits: another program.
    ours = compiled_memory(mixed, BATCH, SEQ)
    theirs = compiled_memory(full, BATCH, SEQ)
    # (mixed_float16 adds the loss scale's few scalars.)
    assert ours.argument_bytes == pytest.approx(theirs.argument_bytes, rel=0.01)
    assert ours.temp_bytes != theirs.temp_bytes


def test_the_command_reports_and_compiles_the_mixed_policy(capfd, tiny_presets_dir):
    args = ["plan", tiny_presets_dir["gemma_mqa"], "--mesh", "batch=2,model=2"]
    args += ["--batch", str(BATCH), "--seq", str(SEQ), "--compiled", "--json"]
    answers = {}
    for dtype in ("float32", "mixed_bfloat16"):
        capfd.readouterr()
        assert cli.main([*args, "--dtype", dtype]) == 0
        answers[dtype] = json.loads(capfd.readouterr().out)
    assert answers["mixed_bfloat16"]["dtype"] == "mixed_bfloat16"
    assert answers["mixed_bfloat16"]["variable_dtype"] == "float32"
    assert answers["float32"]["dtype"] == "float32"
    assert (
        answers["mixed_bfloat16"]["compiled_temp_bytes_per_device"]
        != answers["float32"]["compiled_temp_bytes_per_device"]
    )


def test_mesh_auto_with_more_devices_than_the_default_compiles(tiny_presets_dir):
    # A fresh process: the virtual devices are made before JAX starts.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.pop("JAX_PLATFORMS", None)
    command = [sys.executable, "-m", "keras_hub_autodist", "plan"]
    command += [tiny_presets_dir["gemma_mqa"], "--mesh", "auto", "--devices", "16"]
    command += ["--batch", "16", "--seq", str(SEQ), "--compiled", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)
    assert sum(answer["mesh"].values()) >= 2
    assert np.prod(list(answer["mesh"].values())) == 16
    assert answer["compiled_for"]["devices"] == 16


@pytest.mark.skipif(not HAS_TPU_COMPILER, reason="the TPU compiler is not installed")
def test_device_is_honoured_beside_a_mesh(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    plan = keras_hub_autodist.plan(preset, {"batch": 2, "model": 2})
    cpu_mesh = _mesh((2, 2))
    memory = compiled_memory(plan, BATCH, SEQ, device_mesh=cpu_mesh, device="v5e")
    assert memory.compiled_for() == {
        "platform": "tpu",
        "device_kind": "TPU v5 lite",
        "devices": 4,
    }
    assert memory.target == "v5e"
    # Without device=, the mesh's own devices, as before.
    local = compiled_memory(plan, BATCH, SEQ, device_mesh=cpu_mesh)
    assert local.platform == "cpu" and local.devices == 4


def test_too_few_local_devices_is_refused_naming_the_plan(tiny_presets_dir):
    # This process has 8 (virtual) devices; the plan is for 16.
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], {"batch": 16})
    with pytest.raises(PlanError, match=r"`device='v5e'`.*a plan for 16 devices"):
        compiled_memory(plan, 16, SEQ)
