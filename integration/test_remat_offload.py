"""Why no block policy of `remat=` offloads to the host's memory, checked
against the TPU compiler installed (compiles only: a few minutes)."""

import jax
import pytest
from test_compile_targets import needs_tpu_compiler

from keras_hub_autodist.planning.remat import recomputed_in_backward

pytestmark = pytest.mark.slow


@needs_tpu_compiler
def test_host_offload_keeps_block_inputs_off_a_tpu_only_in_a_scan():
    """Why no block policy offloads to the host's memory: compiled for a
    TPU v5e, JAX's offload of each block's input
    (`save_and_offload_only_these_names`) keeps it off the device when the
    blocks run in a `lax.scan`, and keeps more on the device than no
    offload at all when they are a Python loop, as keras-hub's decoder
    blocks are. A failure here means the compiler now offloads unrolled
    blocks: a policy that offloads the blocks' inputs can then be offered."""
    from jax.ad_checkpoint import checkpoint_name

    from keras_hub_autodist.fitting.compile_targets import compile_target

    device = compile_target("v5e", 1).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    blocks, tokens, width = 4, 8192, 1024
    weight = jax.ShapeDtypeStruct((width, 4 * width), "bfloat16", sharding=sharding)
    inputs = jax.ShapeDtypeStruct((tokens, width), "bfloat16", sharding=sharding)
    input_bytes = tokens * width * 2

    def block(x, w):
        return x + jax.numpy.tanh(x @ w) @ w.T

    def named_block(x, w):
        return block(checkpoint_name(x, "block_input"), w)

    offload = jax.checkpoint(
        named_block,
        policy=jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["block_input"],
            offload_src="device",
            offload_dst="pinned_host",
        ),
    )

    def unrolled(each):
        def loss(w, x):
            for _ in range(blocks):
                x = each(x, w)
            return x.astype("float32").sum()

        return loss

    def scanned(each):
        def loss(w, x):
            x, _ = jax.lax.scan(lambda x, _: (each(x, w), None), x, length=blocks)
            return x.astype("float32").sum()

        return loss

    def memory(loss):
        compiled = jax.jit(jax.grad(loss)).lower(weight, inputs).compile()
        stats = compiled.memory_analysis()
        return stats.temp_size_in_bytes, stats.host_temp_size_in_bytes

    full = jax.checkpoint(block)
    scan_full, _ = memory(scanned(full))
    scan_offload, scan_host = memory(scanned(offload))
    assert scan_host >= blocks * input_bytes
    assert scan_offload < scan_full - (blocks - 2) * input_bytes

    def recomputed(x, w):
        return recomputed_in_backward(block, x, w)

    loop_full, _ = memory(unrolled(recomputed))
    loop_none, _ = memory(unrolled(block))
    loop_offload, _ = memory(unrolled(offload))
    assert loop_full < loop_none <= loop_offload, (loop_full, loop_none, loop_offload)
