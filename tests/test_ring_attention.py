"""The `ring` strategy of attention per device on a context mesh: keys and
values passed around the context axis block by block, checked against the
whole score matrix (forward and gradients) and against `all_gather`."""

import jax
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import assert_same_training
from test_context_attention import WINDOWED
from test_context_attention import counting_kernel
from test_context_attention import padded_batch
from test_fused_context_attention import MESHES
from test_fused_context_attention import assert_equals_the_whole_matrix
from test_fused_context_attention import inputs
from test_fused_context_attention import per_device
from test_fused_context_attention import reference

import keras_hub_autodist
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.fitting.compiled_analysis import collectives
from keras_hub_autodist.fitting.report import context_parallel_note

RULES = {
    "causal": AttentionRule(0.25, key_block=64),
    "cap_window": AttentionRule(0.25, soft_cap=2.0, window=100, key_block=64),
    "keyless_mean": AttentionRule(0.25, keyless_mean=True, key_block=64),
    "bidirectional": AttentionRule(0.25, causal=False, key_block=64),
}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_ring_equals_the_whole_matrix(rule, mesh_name):
    rule = RULES[rule]
    q, k, v, valid = inputs(sequence=512, dim=16)
    attention = jax.jit(per_device(rule, None, mesh_name, strategy="ring"))
    assert_equals_the_whole_matrix(attention, rule, q, k, v, valid)


def test_ring_with_one_key_value_head_split_over_the_model_axis():
    # 4 query heads over 1 key/value head on model=2: each device slices
    # its head's keys before they travel.
    rule = RULES["causal"]
    q, k, v, valid = inputs(sequence=256, heads=4, kv_heads=1, dim=16)
    attention = jax.jit(per_device(rule, None, "model_context", strategy="ring"))
    np.testing.assert_allclose(
        attention(q, k, v, valid), reference(rule, q, k, v, valid), atol=2e-5
    )


def test_the_ring_passes_blocks_and_gathers_nothing():
    rule = RULES["causal"]
    q, k, v, valid = inputs(batch=1, sequence=512, dim=16)

    def step(strategy):
        attention = per_device(rule, None, "model_context", strategy=strategy)
        loss = lambda q, k, v: (attention(q, k, v, valid) ** 2).sum()  # noqa: E731
        return jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()

    def bytes_by_kind(text):
        return {c.kind: c.bytes for c in collectives(text)}

    ring, gathered = bytes_by_kind(step("ring")), bytes_by_kind(step("all_gather"))
    assert ring.get("all-gather", 0) == 0
    assert gathered["all-gather"] > 0
    # Per device, one key/value head (2 over model=2) of 128 tokens: the
    # keys and values pass 3 times forward and 3 times backward, their
    # gradients 4 times (back to their owner).
    block = (512 // 4) * 1 * 16 * 4
    assert ring["collective-permute"] >= (3 * 2 + 3 * 2 + 4 * 2) * block


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("gemma_mqa", {"batch": 1, "context": 4, "model": 2}),
        ("llama3_untied", {"batch": 2, "context": 4}),
    ],
)
def test_a_ring_model_trains_and_predicts_as_one_device(
    tiny_presets_dir, monkeypatch, name, mesh
):
    preset = tiny_presets_dir[name]
    batch = padded_batch(preset)
    one = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    expected = np.asarray(one.predict(batch[0], verbose=0))
    calls = counting_kernel(monkeypatch, "ring_attention")
    lm = keras_hub.models.CausalLM.from_preset(
        preset,
        preprocessor=None,
        device_mesh=mesh,
        context_parallel_strategy="ring",
    )
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), expected, rtol=1e-5, atol=1e-4
    )
    # One ring per decoder block, both of its half blocks of queries at once.
    assert len(calls) == lm.backbone.num_layers, calls
    assert_same_training(
        preset, batch=batch, device_mesh=mesh, context_parallel_strategy="ring"
    )


def test_a_sliding_window_family_on_the_ring(tmp_path, monkeypatch):
    """Qwen3-MoE on its `Softmax` path, which masks its window."""
    (backbone, task, config), window, module = WINDOWED["qwen3_moe"]
    monkeypatch.setattr(f"{module}.fused_attention_op_available", lambda: False)
    preset = tiny_presets.save_preset(
        tmp_path / "qwen3_moe", backbone, {**config, **window}, task_class=task
    )
    calls = counting_kernel(monkeypatch, "ring_attention")
    batch = padded_batch(preset)
    expected = np.asarray(
        task.from_preset(preset, preprocessor=None).predict(batch[0], verbose=0)
    )
    lm = task.from_preset(
        preset,
        preprocessor=None,
        device_mesh={"batch": 2, "context": 4},
        context_parallel_strategy="ring",
    )
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), expected, rtol=1e-5, atol=1e-4
    )
    assert {(rule.window, rule.keyless_mean) for rule in calls} == {(4, False)}


def test_the_strategy_is_checked_and_reported(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    with pytest.raises(StrategyError, match="context_parallel_strategy='rings'"):
        keras_hub_autodist.plan(
            preset, {"batch": 1, "context": 8}, context_parallel_strategy="rings"
        )
    mesh = {"batch": 1, "context": 8}
    gathered = keras_hub_autodist.plan(preset, mesh)
    ring = keras_hub_autodist.plan(preset, mesh, context_parallel_strategy="ring")
    assert gathered.context_parallel_strategy == "all_gather"
    assert "(ring)" in context_parallel_note(ring)
    # Both compile to the same peak (docs/long-context.md, "Strategy"): one
    # estimate for both.
    assert gathered.activation_bytes_per_device(1, 4096) == (
        ring.activation_bytes_per_device(1, 4096)
    )
