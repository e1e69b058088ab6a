"""A tiny Gemma 2 whose attention caps its scores hard, run through
`train_on_batch`, `evaluate` and `predict` on one device: the chip's test
(`test_on_tpu.py`) compares the chip's figures with the CPU's, which this
module prints for plain keras-hub when run as a script in a process of
its own:

    JAX_PLATFORMS=cpu python tests/soft_capped_steps.py PRESET SEQUENCE

A cap of 1.0 moves the loss by about 3e-3 relative, far more than float32
rounding does, so a model run without its cap is told apart.
"""

import json
import sys

import numpy as np

CONFIG = dict(
    vocabulary_size=512,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=256,
    intermediate_dim=512,
    head_dim=128,
    query_head_dim_normalize=True,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    final_logit_soft_cap=30.0,
    attention_logit_soft_cap=1.0,
    use_sliding_window_attention=False,
)
# The chip's cases: (sequence, the products' precision, the relative bound
# on the losses against the CPU's). The lengths: one shorter than any
# kernel block, where the layers attend by their own path with the cap,
# and one long enough for the plugin's kernels. With every product in float32
# ("highest") the chip's loss is the CPU's within 2e-7 at 64 tokens; at
# the TPU's default the layers' dense products (keras-hub's, not the
# attention's) take bfloat16 passes, 1.1e-4 of the loss at 64 tokens
# (measured on a v5e), 70 times less than the cap moves it (7.8e-3). At
# 1,024 tokens the splash kernel attends and the default is within 1e-4.
CHIP_CASES = (
    (64, "highest", 1e-4),
    (64, None, 5e-4),
    (1024, None, 1e-4),
)


def batch(sequence: int):
    """Two rows of tokens, the second padded on the right, their labels
    and the padding as sample weights."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CONFIG["vocabulary_size"], (2, sequence)).astype("int32")
    padding = np.ones_like(ids)
    padding[1, sequence // 2 :] = 0
    x = {"token_ids": ids, "padding_mask": padding}
    return x, np.roll(ids, -1, 1), padding.astype("float32")


def figures(preset: str, sequence: int, device_mesh=None) -> dict:
    """`train_on_batch`'s, `evaluate`'s and `predict`'s losses of the
    preset's Gemma 2 in float32, one Adam step from its saved weights."""
    import keras
    import keras_hub

    import keras_hub_autodist  # noqa: F401  (the plugin, without a .pth hook)

    kwargs = {} if device_mesh is None else {"device_mesh": device_mesh}
    lm = keras_hub.models.GemmaCausalLM.from_preset(
        preset, preprocessor=None, dtype="float32", **kwargs
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    x, y, weights = batch(sequence)
    evaluated = lm.evaluate(
        x, y, sample_weight=weights, batch_size=2, verbose=0, return_dict=True
    )
    logits = np.asarray(lm.predict(x, batch_size=2, verbose=0), np.float64)
    trained = lm.train_on_batch(x, y, weights, return_dict=True)
    return dict(
        train_on_batch=float(trained["loss"]),
        evaluate=float(evaluated["loss"]),
        predict=_cross_entropy(logits, y, weights),
    )


def _cross_entropy(logits, labels, weights) -> float:
    """The mean cross-entropy of the weighted tokens, as Keras reduces it
    (the sum over the weighted tokens over the count of all tokens)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return float(-(picked * weights).sum() / weights.size)


if __name__ == "__main__":
    preset, sequence = sys.argv[1], int(sys.argv[2])
    print(json.dumps(figures(preset, sequence)))
