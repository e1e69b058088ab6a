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


def test_keras_attention_takes_no_soft_cap_when_traced_for_a_tpu():
    """On a TPU, Keras' attention with keras-hub's traced mask falls back to
    XLA's, which drops `attn_logits_soft_cap`; Keras refuses the argument
    where JAX's devices are not TPUs. Traced for a TPU, it is dropped."""
    import keras
    import numpy as np

    q = np.random.default_rng(0).normal(size=(1, 4, 2, 8)).astype("float32")
    with pytest.raises(ValueError, match="only supported for JAX on TPU"):
        keras.ops.dot_product_attention(q, q, q, attn_logits_soft_cap=1.0)
    with compat.answering_for("tpu", "TPU v5 lite"):
        capped = keras.ops.dot_product_attention(q, q, q, attn_logits_soft_cap=1.0)
    np.testing.assert_allclose(capped, keras.ops.dot_product_attention(q, q, q))


SOFT_CAPPED_GEMMA = {
    "class_name": "GemmaBackbone",
    "config": dict(
        TILED_GEMMA["config"],
        attention_logit_soft_cap=50.0,
        final_logit_soft_cap=30.0,
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        query_head_dim_normalize=False,
    ),
}


@needs_tpu_compiler
def test_a_soft_capped_gemma_compiles_for_a_tpu_without_keras_fused_call(
    monkeypatch,
):
    """Keras' fused call drops the soft cap on a TPU: a bound model's
    soft-capped layers never ask for it, where an uncapped one takes it."""
    plan = keras_hub_autodist.plan(SOFT_CAPPED_GEMMA, {"batch": 1}, device_memory="v5e")
    choices = _fused_choices(monkeypatch)
    memory = compiled_memory(plan, 2, 16, preset=SOFT_CAPPED_GEMMA, device="v5e")
    assert memory.platform == "tpu" and not memory.out_of_memory
    assert choices == []


@needs_tpu_compiler
@pytest.mark.parametrize("device, kernel", [("v3-8", "xla"), ("v5e", "splash")])
def test_a_tpu_that_cant_compile_splash_attends_blockwise(monkeypatch, device, kernel):
    """A TPU v3's Mosaic refuses splash's bfloat16 products: where the rule
    wants a kernel (XLA's scores past its limit, here any), a v3 attends
    with the blockwise kernel, XLA's own matmuls, and the step compiles."""
    from keras_hub_autodist.attention import attention_blocks

    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 0)
    plan = keras_hub_autodist.plan(
        TILED_GEMMA, {"batch": 2}, dtype="bfloat16", device_memory=device
    )
    memory = compiled_memory(plan, 2, 256, preset=TILED_GEMMA, device=device)
    assert memory.platform == "tpu" and not memory.out_of_memory
    assert memory.attention == kernel
