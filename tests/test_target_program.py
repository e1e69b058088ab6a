"""A target compile traces the program the target runs, not this machine's.

keras-hub's Gemma, Gemma 3, Gemma 4, Mixtral and Qwen-MoE attention choose
a fused path by the devices they run on (`running_on_tpu()`,
`running_on_gpu()`, the GPU's name). Compiled here for a TPU, the step must
take the TPU's path; for a T4, the T4's.
"""

import importlib
import pkgutil
import sys
import threading

import keras_hub
import pytest
from keras_hub.src.models.gemma import gemma_attention
from keras_hub.src.utils import keras_utils
from test_compile_targets import TILED_GEMMA
from test_compile_targets import needs_gpu_compiler
from test_compile_targets import needs_tpu_compiler

import keras_hub_autodist
from keras_hub_autodist import compat
from keras_hub_autodist.compat import devices
from keras_hub_autodist.fitting.compiled_step import compiled_memory


def test_keras_hubs_device_checks_answer_for_the_target_in_this_thread_only():
    assert not gemma_attention.running_on_tpu()  # this machine: CPU
    seen_elsewhere = []
    with compat.answering_for("tpu", "TPU v5 lite"):
        assert gemma_attention.running_on_tpu()
        assert not gemma_attention.running_on_gpu()
        other = threading.Thread(
            target=lambda: seen_elsewhere.append(gemma_attention.running_on_tpu())
        )
        other.start()
        other.join()
        with compat.answering_for("gpu", "Tesla T4"):
            assert gemma_attention.running_on_gpu()
            assert not keras_utils.gpu_supports_fused_attention_op()  # T4 denied
        with compat.answering_for("gpu", "NVIDIA H100 80GB HBM3"):
            assert keras_utils.gpu_supports_fused_attention_op()
        assert gemma_attention.running_on_tpu()
    assert seen_elsewhere == [False]
    assert not gemma_attention.running_on_tpu()
    assert keras_hub_autodist.compat.installed_patches() == {}


def test_every_keras_hub_module_that_checks_the_devices_is_answered():
    """An upgrade of keras-hub that adds a family choosing its attention by
    the devices fails here until `compat.devices` lists it."""
    for info in pkgutil.walk_packages(
        keras_hub.src.models.__path__, "keras_hub.src.models."
    ):
        try:
            importlib.import_module(info.name)
        except ImportError:  # a family needing a package not installed
            continue
    checking = {
        name
        for name, module in list(sys.modules.items())
        if name.startswith("keras_hub.src.") and module is not keras_utils
        for check in ("running_on_tpu", "running_on_gpu")
        if vars(module).get(check) is getattr(keras_utils, check)
    }
    assert checking == set(devices.CHECKING_MODULES)


def _fused_choices(monkeypatch):
    """The answers of Gemma's `_use_fused_attention_op` while tracing."""
    choices = []
    original = gemma_attention.CachedGemmaAttention._use_fused_attention_op

    def recorded(layer):
        choices.append(original(layer))
        return choices[-1]

    monkeypatch.setattr(
        gemma_attention.CachedGemmaAttention, "_use_fused_attention_op", recorded
    )
    return choices


def _compile(device, monkeypatch):
    plan = keras_hub_autodist.plan(TILED_GEMMA, {"batch": 1}, device_memory=device)
    choices = _fused_choices(monkeypatch)
    memory = compiled_memory(plan, 2, 16, preset=TILED_GEMMA, device=device)
    return memory, set(choices)


@needs_tpu_compiler
def test_a_tpu_compile_takes_the_tpus_attention_path(monkeypatch):
    memory, choices = _compile("v5e", monkeypatch)
    assert memory.platform == "tpu" and not memory.out_of_memory
    assert choices == {True}
    # ... while a compile for this machine takes this machine's.
    local, choices = _compile(None, monkeypatch)
    assert local.platform == "cpu" and choices == {False}


@needs_gpu_compiler
@pytest.mark.parametrize("device, fused", [("t4", False), ("h100", True)])
def test_a_gpu_compile_takes_that_gpus_attention_path(monkeypatch, device, fused):
    memory, choices = _compile(device, monkeypatch)
    assert memory.platform == "gpu"
    assert choices == {fused}
