"""cuDNN's fused (flash) attention on one device, padding per row.

JAX's `dot_product_attention(implementation="cudnn")` masks padding by
each row's number of keys (`key_value_seq_lengths`): the keys must be the
first of the row. keras-hub's padding is one run of tokens per row, on the
right (training batches) or on the left (prompts). Each row is rotated so
that its run of tokens starts it, attended, and rotated back: a causal or
sliding-window mask compares positions by their difference, which the
rotation keeps. A padding query that had no key before it (left padding)
is answered as keras-hub answers it (`AttentionRule.keyless_mean`), and a
batch with a row whose tokens are not one run takes the blockwise path.

cuDNN's kernel takes bfloat16 or float16, a head dimension of at most 128
(a multiple of 8) and no soft cap, on a GPU of compute capability 8.0 or
more (`applies`), where JAX finds cuDNN (`available`). Off a GPU (tests,
this package's CI) the same call runs JAX's XLA implementation, which
takes the same arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.attention.blockwise_attention import blockwise_attention
from keras_hub_autodist.attention.blockwise_attention import rows_with_a_key
from keras_hub_autodist.compat import devices as compat_devices

# What cuDNN's flash attention takes (JAX's `check_is_flash_attention`).
MIN_COMPUTE_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 128
HEAD_DIM_MULTIPLE = 8
DTYPES = ("bfloat16", "float16")


def applies(device, head_dim: int, dtype, soft_cap: float | None) -> bool:
    """Whether cuDNN's flash attention takes this layer on `device`.

    Example:
    >>> class H100: platform, compute_capability = "gpu", "9.0"
    >>> class T4: platform, compute_capability = "gpu", "7.5"
    >>> applies(H100, 128, "bfloat16", None), applies(T4, 128, "bfloat16", None)
    (True, False)
    >>> applies(H100, 256, "bfloat16", None), applies(H100, 64, "float32", None)
    (False, False)
    """
    return why_not(device, head_dim, dtype, soft_cap) is None


def why_not(device, head_dim: int, dtype, soft_cap: float | None) -> str | None:
    """Why cuDNN's flash attention doesn't take this layer on `device`, in
    words a user can act on; None where it does.

    Example:
    >>> class T4: platform, compute_capability = "gpu", "7.5"
    >>> why_not(T4, 128, "bfloat16", None)
    "the GPU's compute capability is 7.5, under cuDNN's flash attention's 8.0"
    """
    capability = getattr(device, "compute_capability", None)
    platform = getattr(device, "platform", None)
    if platform != "gpu" or not capability:
        return f"the device is not a GPU (platform {platform!r})"
    version = tuple(int(part) for part in str(capability).split(".")[:2])
    if version < MIN_COMPUTE_CAPABILITY:
        least = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return (
            f"the GPU's compute capability is {capability}, under cuDNN's "
            f"flash attention's {least}"
        )
    if head_dim > MAX_HEAD_DIM or head_dim % HEAD_DIM_MULTIPLE:
        return (
            f"the head dimension is {head_dim}; cuDNN's flash attention takes "
            f"multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
        )
    if jnp.dtype(dtype).name not in DTYPES:
        return (
            f"the layers compute in {jnp.dtype(dtype).name}; cuDNN's flash "
            "attention takes bfloat16 or float16 (load with dtype='bfloat16')"
        )
    if soft_cap is not None:
        return "the attention logits are soft-capped, which cuDNN's kernel can't do"
    return None


def available() -> bool:
    """Whether JAX finds cuDNN to lower the kernel with (a GPU machine's
    JAX does; a compile for a named GPU on another machine needs the
    `nvidia-cudnn-cu12` wheel, and without it compiles the layer's own
    attention)."""
    return compat_devices.cudnn_version() is not None


def attend(rule: AttentionRule, query, key, value, key_valid, implementation: str):
    """One device's whole sequences attended by cuDNN's kernel.

    Args:
        rule: the `AttentionRule` (no soft cap).
        query: `[batch, sequence, kv_heads, groups, head_dim]`.
        key: `[batch, sequence, kv_heads, head_dim]`.
        value: as `key`.
        key_valid: `[batch, sequence]` bool, `False` on padding.
        implementation: `"cudnn"`, or `"xla"` off a GPU.

    Returns:
        As `query`.
    """
    batch, length, kv_heads, groups, head_dim = query.shape
    positions = jnp.arange(length, dtype=jnp.int32)
    tokens = jnp.sum(key_valid, axis=1, dtype=jnp.int32)
    first = jnp.argmax(key_valid, axis=1).astype(jnp.int32)
    one_run = jnp.all(
        key_valid
        == (
            (positions[None] >= first[:, None])
            & (positions[None] < (first + tokens)[:, None])
        )
    )

    def fused(query, key, value):
        order = (positions[None] + first[:, None]) % length
        back = (positions[None] - first[:, None]) % length

        def rotate(values, index):
            shape = index.shape + (1,) * (values.ndim - 2)
            return jnp.take_along_axis(values, index.reshape(shape), axis=1)

        window = None if rule.window is None else (rule.window - 1, 0)
        heads = rotate(query, order).reshape(batch, length, kv_heads * groups, head_dim)
        output = jax.nn.dot_product_attention(
            heads,
            rotate(key, order),
            rotate(value, order),
            scale=rule.scale,
            is_causal=rule.causal,
            # A row without a token attends its first key: its queries are
            # all answered as keyless below.
            key_value_seq_lengths=jnp.maximum(tokens, 1),
            local_window_size=window,
            implementation=implementation,
        )
        return rotate(output.reshape(query.shape), back)

    def blockwise(query, key, value):
        return blockwise_attention(
            rule, query, key, value, positions, positions, key_valid
        ).astype(query.dtype)

    if rule.window is not None and not rule.causal:
        # A window on the keys before a query only, with every key after
        # it: cuDNN takes a right window only with a causal mask.
        output = blockwise(query, key, value)
    else:
        output = jax.lax.cond(one_run, fused, blockwise, query, key, value)
    has_key = rows_with_a_key(rule, positions, key_valid)[:, :, None, None, None]
    keyless = jnp.zeros((), output.dtype)
    if rule.keyless_mean:
        keyless = value.astype(jnp.float32).mean(axis=1)[:, None, :, None, :]
    return jnp.where(has_key, output, keyless.astype(output.dtype))
