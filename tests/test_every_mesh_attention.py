"""Attention per device off a context mesh: on a batch and model mesh and on
one device, each layer attends its rows' whole sequences with the
platform's kernel (`PLATFORM_KERNELS`: splash on a TPU, checked here in
Pallas' interpreter, cuDNN's call on a GPU, checked here in XLA's
implementation, the blockwise kernel on this CPU), padding per row, sliding
windows and soft caps as keras-hub computes them, against the same model on
one device without the plugin; `generate` keeps the layer's cached path.
The head dimensions of the families people fine-tune (64: Llama 3.2 1B,
Qwen 2.5 0.5B; 96: Phi-3; 128; 256: Gemma) and a sequence of part blocks
(splash pads both around the kernel)."""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

from keras_hub_autodist.attention import attention_blocks
from keras_hub_autodist.attention import context_attention
from keras_hub_autodist.errors import KeptAttentionWarning

# Not a whole number of splash's blocks of 128 tokens.
SEQUENCE = 200
# Windows shorter than the sequence and left and right padding of different
# lengths per row.
GEMMA3 = dict(tiny_presets.GEMMA3_TEXT, head_dim=128, sliding_window_size=64)
GEMMA2 = dict(tiny_presets.GEMMA2_GQA, head_dim=256, sliding_window_size=64)
# Llama 3.2's and Qwen 2.5's heads of 64 (Qwen's tied head, one key/value
# head), Phi-3's of 96.
LLAMA3 = dict(tiny_presets.LLAMA3, hidden_dim=256, num_query_heads=4)
QWEN2 = dict(
    tiny_presets.QWEN2,
    hidden_dim=128,
    num_query_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)
PHI3 = dict(tiny_presets.PHI3, hidden_dim=192, num_query_heads=2, num_key_value_heads=2)


@pytest.fixture
def kernel_at_every_length(monkeypatch):
    """The platform's kernel taken at every length: whatever XLA's scores
    take (`XLA_SCORES_MAX_BYTES`) is more than the rule allows."""
    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 0)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernels the per-device attention ran, one entry per layer call."""
    calls = []
    for name in ("blockwise_attention",):
        original = getattr(context_attention, name)

        def counting(*args, _original=original, **kwargs):
            calls.append("blockwise")
            return _original(*args, **kwargs)

        monkeypatch.setattr(context_attention, name, counting)
    attend = context_attention.splash_attention.attend

    def counting_splash(*args, **kwargs):
        calls.append("splash")
        return attend(*args, **kwargs)

    monkeypatch.setattr(context_attention.splash_attention, "attend", counting_splash)
    cudnn = context_attention.cudnn_attention.attend

    def counting_cudnn(*args, **kwargs):
        calls.append("cudnn")
        return cudnn(*args, **kwargs)

    monkeypatch.setattr(context_attention.cudnn_attention, "attend", counting_cudnn)
    return calls


def _preset(tmp_path, backbone_class, task_class, config):
    return tiny_presets.save_preset(
        tmp_path / backbone_class.__name__,
        backbone_class,
        config,
        task_class=task_class,
    )


def _batch(vocabulary):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (4, SEQUENCE)).astype("int32")
    padding = np.ones_like(ids)
    padding[0, 150:] = 0  # right padding
    padding[1, 100:] = 0
    padding[2, :30] = 0  # left padding: its first tokens have no key
    return {"token_ids": ids, "padding_mask": padding}, padding


def _train(path, task_class, device_mesh=None):
    kwargs = {} if device_mesh is None else {"device_mesh": device_mesh}
    lm = task_class.from_preset(path, preprocessor=None, **kwargs)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    x, padding = _batch(lm.backbone.vocabulary_size)
    y = np.roll(x["token_ids"], -1, axis=1)
    logs = [
        lm.train_on_batch(x, y, padding.astype("float32"), return_dict=True)
        for _ in range(2)
    ]
    return lm, logs, lm.predict(x, verbose=0)


CASES = {
    "gemma3-splash-batch2-model4": ("gemma3", "splash", {"batch": 2, "model": 4}),
    "gemma3-splash-one-device": ("gemma3", "splash", "one device"),
    "gemma2-blockwise-model8": ("gemma2", "blockwise", {"batch": 1, "model": 8}),
    "gemma2-splash-batch4-model2": ("gemma2", "splash", {"batch": 4, "model": 2}),
    "llama3-splash-one-device": ("llama3", "splash", "one device"),
    "qwen2-splash-batch4-model2": ("qwen2", "splash", {"batch": 4, "model": 2}),
    "phi3-splash-batch2-model4": ("phi3", "splash", {"batch": 2, "model": 4}),
    "llama3-blockwise-batch2-model4": ("llama3", "blockwise", {"batch": 2, "model": 4}),
    # cuDNN's call as a GPU makes it, run by XLA here (no soft cap: Gemma 3).
    "gemma3-cudnn-batch2-model4": ("gemma3", "cudnn", {"batch": 2, "model": 4}),
    "gemma3-cudnn-one-device": ("gemma3", "cudnn", "one device"),
}
FAMILIES = {
    "gemma3": (
        keras_hub.models.Gemma3Backbone,
        keras_hub.models.Gemma3CausalLM,
        GEMMA3,
    ),
    "gemma2": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM, GEMMA2),
    "llama3": (
        keras_hub.models.Llama3Backbone,
        keras_hub.models.Llama3CausalLM,
        LLAMA3,
    ),
    "qwen2": (keras_hub.models.QwenBackbone, keras_hub.models.QwenCausalLM, QWEN2),
    "phi3": (keras_hub.models.Phi3Backbone, keras_hub.models.Phi3CausalLM, PHI3),
}


def _any_device(device, head_dim, dtype, soft_cap):
    """`cudnn_attention.why_not` for a GPU that takes every layer but a
    soft-capped one."""
    return None if soft_cap is None else "soft-capped"


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_device_attends_with_the_kernel_as_one_device_does(
    case, tmp_path, monkeypatch, kernel_calls, kernel_at_every_length
):
    family, kernel, mesh = CASES[case]
    backbone_class, task_class, config = FAMILIES[family]
    path = _preset(tmp_path, backbone_class, task_class, config)
    reference = _train(path, task_class)
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {"cpu": kernel})
    # This CPU stands for a GPU that cuDNN's kernel takes.
    monkeypatch.setattr(context_attention.cudnn_attention, "why_not", _any_device)
    monkeypatch.setattr(context_attention.cudnn_attention, "available", lambda: True)
    if mesh == "one device":
        devices = keras.distribution.list_devices()[:1]
        mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    ours = _train(path, task_class, mesh)
    # Every layer of the training step, and of predict's, ran the kernel.
    assert kernel_calls and set(kernel_calls) == {kernel}
    for got, want in zip(ours[1], reference[1]):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours[2], reference[2], rtol=2e-3, atol=2e-3)
    if family != "gemma2":
        return  # keras-hub's Gemma 3 generates from a preprocessor's inputs
    # Generating keeps the layer's cached path and its tokens.
    calls = len(kernel_calls)
    prompt = {
        "token_ids": np.array([[5, 6, 7, 0, 0, 0, 0, 0]], "int32"),
        "padding_mask": np.array([[1, 1, 1, 0, 0, 0, 0, 0]], "int32"),
    }
    tokens = [
        lm.generate(prompt, stop_token_ids=None)["token_ids"]
        for lm in (reference[0], ours[0])
    ]
    np.testing.assert_array_equal(*tokens)
    assert len(kernel_calls) == calls


def _scores_at_sequence(mesh_rows: int, heads: int) -> int:
    """XLA's scores of one layer on a device of the batch and model mesh
    below, at `SEQUENCE` tokens."""
    return attention_blocks.xla_scores_bytes(mesh_rows, heads, SEQUENCE)


@pytest.mark.parametrize("side", ["under", "over"])
def test_a_cpu_attends_blockwise_past_the_scores_limit_as_one_device_does(
    side, tmp_path, monkeypatch, kernel_calls
):
    """The platform's own kernel (no kernel table patched) on both sides of
    the limit on XLA's scores: 4 rows over a batch axis of 2, Gemma 3's 4
    query heads over a model axis of 4."""
    backbone_class, task_class, config = FAMILIES["gemma3"]
    path = _preset(tmp_path, backbone_class, task_class, config)
    reference = _train(path, task_class)
    limit = _scores_at_sequence(2, 1)
    monkeypatch.setattr(
        attention_blocks, "XLA_SCORES_MAX_BYTES", limit - (side == "over")
    )
    ours = _train(path, task_class, {"batch": 2, "model": 4})
    expected = {"blockwise"} if side == "over" else set()
    assert set(kernel_calls) == expected
    for got, want in zip(ours[1], reference[1]):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours[2], reference[2], rtol=2e-3, atol=2e-3)


def test_short_sequences_and_platforms_without_a_kernel_keep_the_layers_own(
    tmp_path, monkeypatch, kernel_calls
):
    backbone_class, task_class, config = FAMILIES["gemma3"]
    path = _preset(tmp_path, backbone_class, task_class, config)
    # This CPU's kernel, not measured faster than XLA's, on scores under the
    # limit.
    assert attention_blocks.PLATFORM_KERNELS["cpu"] == "blockwise"
    assert _scores_at_sequence(2, 1) <= attention_blocks.XLA_SCORES_MAX_BYTES
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls == []
    # Splash, under the first length measured faster than XLA's.
    assert not attention_blocks.measured_faster("splash", SEQUENCE)
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {"cpu": "splash"})
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls == []
    # Splash where it is measured faster: every layer.
    monkeypatch.setattr(
        attention_blocks, "KERNEL_SPEEDUPS", {"splash": {SEQUENCE: 1.0}}
    )
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls and set(kernel_calls) == {"splash"}
    kernel_calls.clear()
    # A platform without a kernel, at any length.
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {})
    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 0)
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls == []
    # cuDNN's kernel takes every length where it applies.
    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 2**40)
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {"cpu": "cudnn"})
    monkeypatch.setattr(context_attention.cudnn_attention, "why_not", _any_device)
    monkeypatch.setattr(context_attention.cudnn_attention, "available", lambda: True)
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls and set(kernel_calls) == {"cudnn"}
    kernel_calls.clear()
    monkeypatch.setattr(context_attention.cudnn_attention, "available", lambda: False)
    _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls == []


def test_a_gpu_that_cudnn_refuses_says_why_once_and_keeps_the_layers_own(
    tmp_path, monkeypatch, kernel_calls
):
    class T4:
        platform, compute_capability = "gpu", "7.5"

    cudnn = context_attention.cudnn_attention
    why_not = cudnn.why_not
    # This CPU stands for a T4, whose compute capability cuDNN's flash
    # attention refuses.
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {"cpu": "cudnn"})
    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 0)
    monkeypatch.setattr(context_attention, "_SAID_KEPT", set())
    monkeypatch.setattr(cudnn, "why_not", lambda _, *shape: why_not(T4, *shape))
    backbone_class, task_class, config = FAMILIES["gemma3"]
    path = _preset(tmp_path, backbone_class, task_class, config)
    with pytest.warns(KeptAttentionWarning) as caught:
        _train(path, task_class, {"batch": 2, "model": 4})
    assert kernel_calls == []
    kept = [str(w.message) for w in caught if w.category is KeptAttentionWarning]
    assert kept == [kept[0]] and "compute capability is 7.5" in kept[0], kept
    assert "context" in kept[0]  # what to do instead
