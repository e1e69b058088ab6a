"""The fused kernels of the attention per device on a context mesh: splash
(TPU), checked in Pallas' interpreter against the whole score matrix, in a
bfloat16 model's step whose blocks are recomputed, and compiled for a TPU
target on this machine."""

import functools

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest
from jax.sharding import Mesh
from test_compile_targets import needs_tpu_compiler
from test_context_attention import whole_matrix
from tiny_presets import llama3_preset

import keras_hub_autodist
from keras_hub_autodist.attention import attention_blocks
from keras_hub_autodist.attention import causal_balance
from keras_hub_autodist.attention import context_attention
from keras_hub_autodist.attention import splash_attention
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.errors import TargetCompileError
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.planning.remat import recomputed_in_backward

RULES = {
    "causal": AttentionRule(0.25),
    "cap_window": AttentionRule(0.25, soft_cap=2.0, window=100),
    "keyless_mean": AttentionRule(0.25, keyless_mean=True),
}


def inputs(batch=2, sequence=1024, heads=4, kv_heads=2, dim=128, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, sequence, heads, dim)), "float32")
    k = jnp.asarray(rng.normal(size=(batch, sequence, kv_heads, dim)), "float32")
    v = jnp.asarray(rng.normal(size=(batch, sequence, kv_heads, dim)), "float32")
    steps = np.arange(sequence)
    # The first row is left-padded up to 100, the second right-padded from
    # 900.
    valid = jnp.asarray(np.stack([steps >= 100, steps < 900])[:batch])
    return q, k, v, valid


def reference(rule, q, k, v, valid):
    batch, sequence, heads, dim = q.shape
    grouped = q.reshape(batch, sequence, k.shape[2], heads // k.shape[2], dim)
    positions = jnp.arange(sequence)
    out = whole_matrix(rule, grouped, k, v, positions, positions, valid)
    return out.reshape(q.shape)


MESHES = {"batch_context": (2, 1, 4), "model_context": (1, 2, 4)}


def per_device(rule, kernel, mesh_name, strategy="all_gather"):
    shape = MESHES[mesh_name]
    devices = np.array(jax.devices()[:8]).reshape(shape)
    mesh = Mesh(devices, ("batch", "model", "context"))

    def attention(q, k, v, valid):
        return context_attention.attention_per_device(
            rule,
            q,
            k,
            v,
            valid,
            mesh=mesh,
            batch_axis="batch",
            context_axis="context",
            model_axis="model",
            strategy=strategy,
            kernel=kernel,
        )

    return attention


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_splash_per_device_equals_the_whole_matrix(rule, mesh_name):
    rule = RULES[rule]
    q, k, v, valid = inputs()
    # Padding queries see no key: the layer's answer, not splash's.
    assert_equals_the_whole_matrix(
        jax.jit(per_device(rule, "splash", mesh_name)), rule, q, k, v, valid
    )


def assert_equals_the_whole_matrix(attention, rule, q, k, v, valid):
    """`attention(q, k, v, valid)` and its gradients as `reference`'s."""
    np.testing.assert_allclose(
        attention(q, k, v, valid), reference(rule, q, k, v, valid), atol=2e-5
    )

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, valid) ** 2).sum()

    grads = jax.grad(loss(attention), (0, 1, 2))(q, k, v)
    expected = jax.grad(loss(lambda *a: reference(rule, *a)), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", grads, expected):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4, err_msg=name)


def test_splash_applies_only_where_its_blocks_fit():
    assert attention_blocks.applies(4096, 32768, 8)
    assert not attention_blocks.applies(96, 768, 8)  # no block
    assert not attention_blocks.applies(128, 384, 3)  # 3² does not divide 384


def test_query_order_puts_each_devices_halves_in_its_block():
    order = causal_balance.query_order(16, 4, balanced=True).tolist()
    assert sorted(order) == list(range(16))
    pairs = causal_balance.balanced_chunks(4)
    for device, (head, tail) in enumerate(pairs):
        block = order[4 * device : 4 * device + 4]
        assert block == [2 * head, 2 * head + 1, 2 * tail, 2 * tail + 1]


def products_precisions(function, *args) -> list[str]:
    """The precision of each product in the gradient's program of
    `function`, forward and backward, traced under a global `"highest"`."""
    with jax.default_matmul_precision("highest"):
        program = jax.make_jaxpr(
            jax.grad(lambda *a: function(*a).sum(), argnums=range(len(args)))
        )(*args)
    return [line.strip() for line in str(program).splitlines() if "precision=" in line]


def test_a_kernel_is_traced_at_the_default_precision_forward_and_backward():
    """A user's global `"highest"` reaches no product of the kernel, in its
    forward or its backward pass (Mosaic refuses it on 16-bit operands),
    and the numbers are the same."""
    x, w = jnp.ones((4, 8)), jnp.linspace(0.0, 1.0, 32).reshape(8, 4)

    # A product with its own VJP, as the kernel's: its backward products
    # are traced when the step's gradient is, not with the forward.
    @jax.custom_vjp
    def layer(x, w):
        return x @ w

    def forward(x, w):
        return x @ w, (x, w)

    def backward(saved, cotangent):
        x, w = saved
        return cotangent @ w.T, x.T @ cotangent

    layer.defvjp(forward, backward)
    wrapped = splash_attention.at_default_precision(layer)
    assert set(products_precisions(layer, x, w)) == {
        "precision=(Precision.HIGHEST, Precision.HIGHEST)"
    }
    # One product forward, two backward (x's gradient and w's).
    assert (
        products_precisions(wrapped, x, w)
        == ["precision=(Precision.DEFAULT, Precision.DEFAULT)"] * 3
    )
    np.testing.assert_array_equal(wrapped(x, w), layer(x, w))


@needs_tpu_compiler
def test_a_bfloat16_step_compiles_for_a_tpu_under_a_global_highest_precision(
    tmp_path,
):
    """Compiled for a v5e, a bfloat16 step of 1,024 tokens (splash) under
    `jax.default_matmul_precision("highest")` is the step without it; the
    kernel's products at `"highest"` fail in Mosaic ("Bad lhs type")."""
    preset = llama3_preset(str(tmp_path / "llama"))
    plan = keras_hub_autodist.plan(preset, {"batch": 1, "model": 1}, dtype="bfloat16")
    default = compiled_memory(plan, 2, 1024, device="v5e")
    with jax.default_matmul_precision("highest"):
        highest = compiled_memory(plan, 2, 1024, device="v5e")
    assert default.attention == highest.attention == "splash"
    assert highest.peak_bytes == default.peak_bytes


RECOMPUTED = {
    "jax.checkpoint": jax.checkpoint,
    # The plugin's `remat="full"`: each block recomputed in the backward.
    "block": lambda function: functools.partial(recomputed_in_backward, function),
}


@pytest.mark.parametrize("recompute", list(RECOMPUTED))
def test_a_bfloat16_kernel_differentiates_inside_a_recomputed_block(recompute):
    """A 16-bit kernel (traced at the default precision in its own VJP)
    inside a block that is recomputed in the backward pass has the
    gradients of the same kernel without recomputation: its block tables,
    traced inside `shard_map`, reach the recomputation as arguments, not as
    values of the forward's finished trace (`UnexpectedTracerError` on the
    chip for `remat="full"`)."""
    attention = per_device(RULES["causal"], "splash", "batch_context")
    q, k, v, valid = (
        a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in inputs()
    )

    def loss(q, k, v):
        return (attention(q, k, v, valid).astype(jnp.float32) ** 2).sum()

    expected = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    recomputed = jax.jit(jax.grad(RECOMPUTED[recompute](loss), (0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", recomputed, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


@needs_tpu_compiler
def test_the_target_compile_refuses_a_step_that_holds_a_finished_trace(
    tmp_path, monkeypatch
):
    """A kernel wrapper that closes over the kernel (traced inside
    `shard_map`) leaks its block tables into the step's program under
    `remat="full"`: XLA compiles it, and the chip refuses its first call
    (`UnexpectedTracerError`), so the target compile refuses it too."""
    at_default_precision = splash_attention.at_default_precision

    def closing_over_the_kernel(function):
        def call(kernel, *arrays):
            closed = functools.partial(function, kernel)
            return at_default_precision(closed)(*arrays)

        return call

    monkeypatch.setattr(
        splash_attention, "at_default_precision", closing_over_the_kernel
    )
    preset = llama3_preset(str(tmp_path / "llama"))
    plan = keras_hub_autodist.plan(
        preset, {"batch": 1, "model": 1}, dtype="bfloat16", remat="full"
    )
    with pytest.raises(TargetCompileError, match="trace that had ended"):
        compiled_memory(plan, 2, 1024, device="v5e")


def _trained_bfloat16(preset, monkeypatch, **options):
    """The losses of two `train_on_batch` steps of `preset` in bfloat16 on a
    one-device mesh, each layer attending with splash in Pallas'
    interpreter; the number of the kernel's calls."""
    monkeypatch.setattr(attention_blocks, "PLATFORM_KERNELS", {"cpu": "splash"})
    monkeypatch.setattr(attention_blocks, "XLA_SCORES_MAX_BYTES", 0)
    calls = []
    attend = splash_attention.attend

    def counting(*args, **kwargs):
        calls.append(1)
        return attend(*args, **kwargs)

    monkeypatch.setattr(splash_attention, "attend", counting)
    devices = keras.distribution.list_devices()[:1]
    mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    lm = keras_hub.models.Llama3CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh, dtype="bfloat16", **options
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-2))
    vocabulary = lm.backbone.vocabulary_size
    ids = np.random.default_rng(0).integers(1, vocabulary, (2, 256)).astype("int32")
    padding = np.ones_like(ids)
    padding[1, 200:] = 0
    x = {"token_ids": ids, "padding_mask": padding}
    y = np.roll(ids, -1, axis=1)
    losses = [lm.train_on_batch(x, y, padding.astype("float32")) for _ in range(2)]
    return losses, len(calls)


def test_a_bfloat16_step_recomputing_its_blocks_trains_with_the_kernel(
    tmp_path, monkeypatch
):
    """A bfloat16 step with `remat="full"` attends with the kernel and
    trains as the same step without remat: each block is traced again in
    the backward pass, the kernel in it (its 16-bit products in a VJP of
    their own) with it, which on a TPU once met the kernel's tables after
    their trace had ended (`UnexpectedTracerError` at the first step)."""
    preset = llama3_preset(str(tmp_path / "llama"))
    kept, kept_calls = _trained_bfloat16(preset, monkeypatch)
    recomputed, calls = _trained_bfloat16(preset, monkeypatch, remat="full")
    assert kept_calls and calls
    np.testing.assert_allclose(recomputed, kept, rtol=1e-3)
