"""Which keras-hub attention layers must take their own XLA path, never
Keras' fused `dot_product_attention`:

- on a context mesh, every layer: XLA can't split the fused kernels
  (cuDNN flash attention on GPU, Pallas splash attention on TPU) along the
  sequence, while its own attention splits like every other op
  (`planning.distribution`, whose `ContextParallel` scope answers no to
  Keras' own check for a fused kernel);
- on any mesh, a layer that soft-caps its scores (Gemma 2's
  `attention_logit_soft_cap`): on a TPU, Keras' `dot_product_attention`
  with a traced mask (every training step's) falls back to
  `jax.nn.dot_product_attention` and drops `attn_logits_soft_cap`, so
  keras-hub's fused path computes a model without its cap. keras-hub's own
  XLA path applies the cap. The plugin's per-device kernels apply it too
  (`context_attention`): this is the path of what they leave to the layer
  (decoding with a cache, dropout, a length where XLA's attention is
  taken).
"""

from __future__ import annotations

from keras_hub_autodist import compat
from keras_hub_autodist.compat import attention as compat_attention
from keras_hub_autodist.planning.distribution import context_parallel

# keras-hub's attention layers ask this method whether to call a fused
# kernel (cuDNN flash attention on GPU, Pallas splash attention on TPU).
FUSED_ATTENTION_METHOD = "_use_fused_attention_op"


def _never() -> bool:
    return False


def _soft_capped(layer) -> bool:
    """Whether `layer` is a known attention layer that caps its scores."""
    reading = compat_attention.attention_reading(layer)
    return reading is not None and reading.soft_cap is not None


def attention_through_xla(model, plan) -> int:
    """Make the keras-hub attention layers of `model` that must (see the
    module's docstring) take their XLA path instead of a fused kernel;
    return how many layers changed.

    On CPU keras-hub takes that path already; on GPU keras-hub keeps a
    soft-capped layer off cuDNN itself.

    Args:
        model: a keras-hub Backbone or Task, built.
        plan: its `LayoutPlan`.
    """
    everyone = context_parallel(plan)
    changed = 0
    for layer in compat.sublayers(model):
        if not callable(getattr(layer, FUSED_ATTENTION_METHOD, None)):
            continue
        if everyone or _soft_capped(layer):
            compat.patch_instance(
                "attention_through_xla", layer, FUSED_ATTENTION_METHOD, _never
            )
            changed += 1
    return changed
