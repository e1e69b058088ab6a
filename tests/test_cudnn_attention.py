"""cuDNN's flash attention per device: each row rotated so that its tokens
start it, padding passed as a number of keys, equal to the blockwise
attention on every padding keras-hub makes, and where a row's tokens are
not one run; which GPUs, dtypes and heads it takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keras_hub_autodist.attention import cudnn_attention
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.attention.blockwise_attention import blockwise_attention

BATCH, LENGTH, KV_HEADS, GROUPS, HEAD_DIM = 4, 64, 2, 3, 16


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    query = jax.random.normal(keys[0], (BATCH, LENGTH, KV_HEADS, GROUPS, HEAD_DIM))
    key = jax.random.normal(keys[1], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    value = jax.random.normal(keys[2], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    return query, key, value


def _padding(rows):
    valid = np.ones((BATCH, LENGTH), bool)
    for row, (start, stop) in enumerate(rows):
        valid[row, :start] = False
        valid[row, stop:] = False
    return jnp.asarray(valid)


ONE_RUN = [(0, LENGTH), (0, 40), (17, LENGTH), (0, 0)]  # none, right, left, empty
RULES = {
    "causal": AttentionRule(scale=0.25),
    "window": AttentionRule(scale=0.25, window=9),
    "keyless-mean": AttentionRule(scale=0.25, keyless_mean=True),
    "bidirectional": AttentionRule(scale=0.25, causal=False),
    "bidirectional-window": AttentionRule(scale=0.25, causal=False, window=9),
}


@pytest.mark.parametrize("rule", RULES, ids=list(RULES))
@pytest.mark.parametrize("holes", [False, True], ids=["one-run", "holes"])
def test_equals_the_blockwise_attention(rule, holes):
    rule = RULES[rule]
    query, key, value = _inputs()
    key_valid = _padding(ONE_RUN)
    if holes:  # a row whose tokens are two runs: the blockwise path
        key_valid = key_valid.at[1, 10:20].set(False)
    positions = jnp.arange(LENGTH, dtype=jnp.int32)

    def fused(query, key, value):
        return cudnn_attention.attend(rule, query, key, value, key_valid, "xla")

    def reference(query, key, value):
        return blockwise_attention(
            rule, query, key, value, positions, positions, key_valid
        )

    np.testing.assert_allclose(
        fused(query, key, value), reference(query, key, value), rtol=2e-5, atol=2e-5
    )
    # And the gradients, through the rotation and the keyless rows.
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(
            query, key, value
        )
        for f in (fused, reference)
    ]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


class _Device:
    def __init__(self, platform, compute_capability=None):
        self.platform = platform
        self.compute_capability = compute_capability


def test_the_kernel_takes_ampere_and_later_half_precision_and_small_heads():
    h100, a100 = _Device("gpu", "9.0"), _Device("gpu", "8.0")
    assert cudnn_attention.applies(h100, 128, jnp.bfloat16, None)
    assert cudnn_attention.applies(a100, 64, "float16", None)
    assert not cudnn_attention.applies(_Device("gpu", "7.5"), 128, "bfloat16", None)
    assert not cudnn_attention.applies(_Device("tpu"), 128, "bfloat16", None)
    assert not cudnn_attention.applies(h100, 256, "bfloat16", None)
    assert not cudnn_attention.applies(h100, 100, "bfloat16", None)
    assert not cudnn_attention.applies(h100, 128, "float32", None)
    assert not cudnn_attention.applies(h100, 128, "bfloat16", 50.0)  # soft cap
