"""keras-hub's attention layers on a context mesh take XLA's attention
path, never a fused kernel (cuDNN flash attention on GPU, Pallas splash
attention on TPU): XLA can't split those kernels along the sequence, while
its own attention splits like every other op (`planning.distribution`, whose
`ContextParallel` scope answers no to Keras' own check for a fused kernel).
"""

from __future__ import annotations

from keras_hub_autodist import compat
from keras_hub_autodist.planning.distribution import context_parallel

# keras-hub's attention layers ask this method whether to call a fused
# kernel (cuDNN flash attention on GPU, Pallas splash attention on TPU).
FUSED_ATTENTION_METHOD = "_use_fused_attention_op"


def _never() -> bool:
    return False


def attention_through_xla(model, plan) -> int:
    """On a context mesh, make every keras-hub attention layer of `model`
    take XLA's attention path instead of a fused kernel; return how many
    layers changed (0 without a context axis).

    On CPU keras-hub takes that path already; on GPU and TPU its fused
    kernels can't be split along the sequence (see the module's docstring).

    Args:
        model: a keras-hub Backbone or Task, built.
        plan: its `LayoutPlan`.
    """
    if not context_parallel(plan):
        return 0
    changed = 0
    for layer in compat.sublayers(model):
        if callable(getattr(layer, FUSED_ATTENTION_METHOD, None)):
            compat.patch_instance(
                "attention_through_xla", layer, FUSED_ATTENTION_METHOD, _never
            )
            changed += 1
    return changed
