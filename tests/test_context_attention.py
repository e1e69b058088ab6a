"""Attention run per device on a context mesh: the blockwise kernel against
the whole-matrix attention keras computes, and models on a context mesh
against one device with padded batches. integration/test_context_parallel_matrix.py
runs every family and mesh with left and right padding."""

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import assert_same_training
from equivalence import batch_for

from keras_hub_autodist import compat
from keras_hub_autodist.attention import causal_balance
from keras_hub_autodist.attention import context_attention
from keras_hub_autodist.attention.blockwise_attention import MASKED_SCORE
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.attention.blockwise_attention import blockwise_attention
from keras_hub_autodist.compat import attention as compat_attention

RULES = [
    AttentionRule(0.5, key_block=8),
    AttentionRule(0.5, soft_cap=2.0, window=5, key_block=8),
    AttentionRule(0.25, causal=False, key_block=16),
    AttentionRule(0.5, window=5, keyless_mean=True, key_block=8),
]


def whole_matrix(rule, q, k, v, query_positions, key_positions, valid):
    """Keras' attention: every score at once, masked scores set to -1e9 and
    their weights to zero after the softmax (keras' `Softmax(mask=...)`),
    or left as they are (`jax.nn.dot_product_attention`, `keyless_mean`)."""
    scores = jnp.einsum("btkgd,bskd->bkgts", q * rule.scale, k)
    if rule.soft_cap:
        scores = rule.soft_cap * jnp.tanh(scores / rule.soft_cap)
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = valid[:, None, None, None, :]
    if rule.causal:
        allowed = allowed & (distance >= 0)
    if rule.window:
        allowed = allowed & (distance < rule.window)
    weights = jax.nn.softmax(jnp.where(allowed, scores, MASKED_SCORE), axis=-1)
    if not rule.keyless_mean:
        weights = jnp.where(allowed, weights, 0.0)
    return jnp.einsum("bkgts,bskd->btkgd", weights, v)


@pytest.mark.parametrize(
    "rule", RULES, ids=["causal", "cap_window", "no_mask", "keyless_mean"]
)
def test_blockwise_attention_and_its_gradients_equal_the_whole_matrix(rule):
    rng = np.random.default_rng(0)
    batch, queries, keys, kv_heads, groups, dim = 2, 8, 32, 2, 2, 4
    q = jnp.asarray(rng.normal(size=(batch, queries, kv_heads, groups, dim)), "float32")
    k = jnp.asarray(rng.normal(size=(batch, keys, kv_heads, dim)), "float32")
    v = jnp.asarray(rng.normal(size=(batch, keys, kv_heads, dim)), "float32")
    # The queries are the sequence's 8..15; the first row is left-padded up
    # to 12 (its queries 8..11 see no key), the second right-padded from 11
    # (its query 15 has no key in a window of 5).
    query_positions = jnp.arange(queries) + 8
    key_positions = jnp.arange(keys)
    valid = jnp.asarray(np.stack([np.arange(keys) >= 12, np.arange(keys) < 11]))
    where = (query_positions, key_positions, valid)
    np.testing.assert_allclose(
        blockwise_attention(rule, q, k, v, *where),
        whole_matrix(rule, q, k, v, *where),
        atol=1e-6,
    )

    def loss(attention):
        return lambda *qkv: (attention(rule, *qkv, *where) ** 2).sum()

    got = jax.grad(loss(blockwise_attention), (0, 1, 2))(q, k, v)
    expected = jax.grad(loss(whole_matrix), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


def test_no_step_holds_more_than_a_block_of_scores():
    """The compiled forward and backward hold a `[queries, key block]`
    block of scores, never `[queries, keys]`: the temporaries of 4x the
    keys grow about 4x, not 16x."""
    rule = AttentionRule(0.125, key_block=256)

    def temporaries(keys):
        q = jnp.zeros((1, 1024, 1, 4, 64))
        k = jnp.zeros((1, keys, 1, 64))
        where = (jnp.arange(1024), jnp.arange(keys), jnp.ones((1, keys), bool))

        def loss(q, k, v):
            return blockwise_attention(rule, q, k, v, *where).sum()

        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, k).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temporaries(4096), temporaries(16384)
    # One whole matrix of scores at 16k keys: 4 heads x 1024 x 16384 floats.
    assert large < 4 * 1024 * 16384 * 4 / 2, large
    assert large / small < 4.5, (small, large)


def padded_batch(preset, sequence_length=16, position_ids=False):
    """Row 0 left-padded (its first 3 tokens), row 1 right-padded (its last
    5); the other rows whole. `position_ids` for Gemma 4, which takes them."""
    x, y = batch_for(preset, sequence_length=sequence_length, position_ids=position_ids)
    x["padding_mask"][0, :3] = 0
    x["padding_mask"][1, -5:] = 0
    return x, y


def counting_kernel(monkeypatch, name="blockwise_attention"):
    """The rules `context_attention.<name>` is called with, from now on."""
    calls = []
    kernel = getattr(context_attention, name)

    def counted(rule, *arguments):
        calls.append(rule)
        return kernel(rule, *arguments)

    monkeypatch.setattr(context_attention, name, counted)
    return calls


@pytest.mark.parametrize(
    "name,mesh",
    [
        ("gemma_mqa", {"batch": 1, "context": 4, "model": 2}),
        ("llama3_untied", {"batch": 2, "context": 4}),
    ],
)
def test_padded_training_and_logits_equal_one_device(
    tiny_presets_dir, monkeypatch, name, mesh
):
    preset = tiny_presets_dir[name]
    batch = padded_batch(preset)
    one = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    expected = np.asarray(one.predict(batch[0], verbose=0))
    calls = counting_kernel(monkeypatch)
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), expected, rtol=1e-5, atol=1e-4
    )
    # Each decoder block's attention ran per device, on the head and the
    # tail half blocks of its queries (16 tokens over 4 devices).
    assert len(calls) == 2 * lm.backbone.num_layers, calls
    assert_same_training(preset, batch=batch, device_mesh=mesh)


# The families whose keys and values arrive repeated to the query heads:
# preset name -> its CausalLM class. Key/value heads of 2 (split over the
# model axis), 4 (one per query head) and 1 (sliced per device).
REPEATED_HEADS = {
    **{
        name: tiny_presets.DENSE_FAMILIES[name][1]
        for name in ("qwen2", "qwen3", "phi3", "smollm3")
    },
    **{
        tiny_presets.moe_preset_name(family, 6): tiny_presets.MOE_FAMILIES[family][1]
        for family in ("mixtral", "qwen_moe", "qwen3_moe")
    },
}
# The families that ask their own `_use_fused_attention_op`, which a
# context mesh turns off: keras' `Softmax`, a query with no key gets zeros.
ASK_THEIR_LAYER = ("mixtral", "qwen_moe")


def assert_padded_batch_matches_one_device(
    preset, task, mesh, monkeypatch, position_ids=False
):
    """Logits of a padded batch as one device's, each decoder block's
    attention run per device, and training as one device's; returns the
    rules the attention per device ran with."""
    batch = padded_batch(preset, position_ids=position_ids)
    one = task.from_preset(preset, preprocessor=None)
    expected = np.asarray(one.predict(batch[0], verbose=0))
    calls = counting_kernel(monkeypatch)
    lm = task.from_preset(preset, preprocessor=None, device_mesh=mesh)
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), expected, rtol=1e-5, atol=1e-4
    )
    # Each decoder block's attention ran per device, on the head and the
    # tail half blocks of its queries, in each trace: Keras' `predict` first
    # calls a model with layers left unbuilt (SmolLM3's) once eagerly.
    layers = lm.backbone.get_config()["num_layers"]
    assert calls and len(calls) % (2 * layers) == 0, calls
    method = compat_attention.COMPUTE_ATTENTION_METHOD
    assert sum(method in vars(layer) for layer in compat.sublayers(lm)) == layers
    assert_same_training(preset, task=task, batch=batch, device_mesh=mesh)
    return calls


@pytest.mark.parametrize("name", sorted(REPEATED_HEADS))
def test_repeated_heads_families_equal_one_device(tiny_presets_dir, monkeypatch, name):
    rules = assert_padded_batch_matches_one_device(
        tiny_presets_dir[name],
        REPEATED_HEADS[name],
        {"batch": 1, "context": 4, "model": 2},
        monkeypatch,
    )
    # The others call `ops.dot_product_attention` on JAX: a query with no
    # key gets the mean of the values.
    asks = any(name.startswith(f"{family}_") for family in ASK_THEIR_LAYER)
    assert {rule.keyless_mean for rule in rules} == {not asks}


# Windows of 4 tokens on blocks of 4: Mixtral's decoder blocks mask it,
# Qwen's attention layers on keras' `Softmax` path only (the only path of
# Qwen-MoE's on a context mesh, as of Mixtral's).
WINDOWED = {
    "mixtral": (tiny_presets.MOE_FAMILIES["mixtral"], {"sliding_window": 4}, None),
    "qwen_moe": (
        tiny_presets.MOE_FAMILIES["qwen_moe"],
        {"use_sliding_window_attention": True, "sliding_window_size": 4},
        None,
    ),
    "qwen2": (
        tiny_presets.DENSE_FAMILIES["qwen2"],
        {"use_sliding_window_attention": True, "sliding_window_size": 4},
        "keras_hub.src.models.qwen.qwen_attention",
    ),
    "qwen3": (
        tiny_presets.DENSE_FAMILIES["qwen3"],
        {"sliding_window_size": 4},
        "keras_hub.src.models.qwen3.qwen3_attention",
    ),
    "qwen3_moe": (
        tiny_presets.MOE_FAMILIES["qwen3_moe"],
        {"sliding_window_size": 4},
        "keras_hub.src.models.qwen3_moe.qwen3_moe_attention",
    ),
}


@pytest.mark.parametrize(
    "name,softmax",
    [
        pytest.param(name, softmax, id=f"{name}-{'softmax' if softmax else 'fused'}")
        for name, softmax in [
            ("mixtral", True),
            ("qwen2", False),
            ("qwen2", True),
            ("qwen3", False),
            ("qwen3", True),
            ("qwen_moe", True),
            ("qwen3_moe", False),
            ("qwen3_moe", True),
        ]
    ],
)
def test_sliding_windows_equal_one_device(tmp_path, monkeypatch, name, softmax):
    """Qwen 2, Qwen 3 and Qwen3-MoE on both of their paths; Mixtral and
    Qwen-MoE on their `Softmax` path, which a context mesh takes."""
    (backbone, task, config), window, module = WINDOWED[name]
    if softmax and module:
        # keras-hub's other path, as where `ops.dot_product_attention` is
        # not available: scores, the window and keras' `Softmax`.
        monkeypatch.setattr(f"{module}.fused_attention_op_available", lambda: False)
    preset = tiny_presets.save_preset(
        tmp_path / name, backbone, {**config, **window}, task_class=task
    )
    rules = assert_padded_batch_matches_one_device(
        preset, task, {"batch": 2, "context": 4}, monkeypatch
    )
    # Qwen's window is masked on the `Softmax` path only.
    expected = 4 if softmax or module is None else None
    assert {rule.window for rule in rules} == {expected}
    assert {rule.keyless_mean for rule in rules} == {module is not None and not softmax}


@pytest.mark.parametrize(
    "name,mesh",
    [
        # Local and global layers, a global head size of 16 with one
        # key/value head (keys as values), the last layer attending the
        # first's keys and values.
        ("gemma4", {"batch": 1, "context": 4, "model": 2}),
        # Every layer with its own keys and values, soft-capped scores.
        ("gemma4_no_global_heads", {"batch": 2, "context": 4}),
    ],
)
def test_gemma4_equals_one_device(tiny_presets_dir, monkeypatch, name, mesh):
    preset = tiny_presets_dir[name]
    task = tiny_presets.DENSE_FAMILIES["gemma4"][1]
    rules = assert_padded_batch_matches_one_device(
        preset, task, mesh, monkeypatch, position_ids=True
    )
    config = tiny_presets.DENSE_VARIANTS[name][2]
    # Layer `i` is global when `i % pattern == pattern - 1`: no window.
    pattern = config["sliding_window_pattern"]
    windows = [
        None if i % pattern == pattern - 1 else config["sliding_window_size"]
        for i in range(config["num_layers"])
    ]
    # Two calls per layer (head and tail half blocks), in each trace.
    assert [rule.window for rule in rules[::2]][: len(windows)] == windows
    cap = config.get("attention_logit_soft_cap")
    assert {(rule.scale, rule.soft_cap, rule.keyless_mean) for rule in rules} == {
        (1.0, cap, False)
    }


def test_the_known_attention_layers_are_replaced_on_every_mesh(tiny_presets_dir):
    preset = tiny_presets_dir["gemma3_text"]
    method = compat_attention.COMPUTE_ATTENTION_METHOD
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "context": 4}
    )
    replaced = [layer for layer in compat.sublayers(lm) if method in vars(layer)]
    assert len(replaced) == lm.backbone.num_layers
    readings = [compat_attention.attention_reading(layer) for layer in replaced]
    # Gemma 3's local layers have a window, its global ones none.
    windows = [
        layer.sliding_window_size if layer.use_sliding_window_attention else None
        for layer in replaced
    ]
    assert [r.window for r in readings] == windows
    assert lm.backbone.sliding_window_size in windows
    # Off a context mesh too: there each layer attends per device where its
    # platform has a kernel (tests/test_every_mesh_attention.py), and keeps
    # its own attention elsewhere.
    plain = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 8}
    )
    replaced = [layer for layer in compat.sublayers(plain) if method in vars(layer)]
    assert len(replaced) == plain.backbone.num_layers


def test_every_known_attention_class_exists():
    for module, name in compat_attention.known_attention_classes():
        assert hasattr(__import__(module, fromlist=[name]), name), (module, name)


def test_outside_a_context_scope_the_layer_computes_as_its_own(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "context": 4}
    )
    x, _ = batch_for(preset, sequence_length=8)
    # Called eagerly without the distribution's scope: keras-hub's path.
    assert keras.distribution.distribution() is None
    calls = []
    original = context_attention.blockwise_attention
    try:
        context_attention.blockwise_attention = lambda *a: calls.append(a)
        lm.backbone({k: keras.ops.convert_to_tensor(v) for k, v in x.items()})
    finally:
        context_attention.blockwise_attention = original
    assert calls == []


@pytest.mark.parametrize("contexts", [2, 4, 8])
def test_causal_work_is_balanced_over_the_context_axis(contexts):
    """Head-and-tail half blocks: every device computes as many unmasked
    score blocks as the mean (within 10%); contiguous blocks don't."""
    sequence = 32768
    balanced = causal_balance.score_blocks_per_device(sequence, contexts, 512)
    mean = sum(balanced) / contexts
    assert all(abs(blocks - mean) <= 0.1 * mean for blocks in balanced), balanced
    contiguous = causal_balance.score_blocks_per_device(
        sequence, contexts, 512, balanced=False
    )
    assert max(contiguous) > 1.1 * sum(contiguous) / contexts, contiguous
    pairs = causal_balance.balanced_chunks(contexts)
    # Every half block is attended exactly once.
    assert sorted(c for pair in pairs for c in pair) == list(range(2 * contexts))
