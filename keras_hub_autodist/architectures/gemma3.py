"""Gemma 3 (`Gemma3Backbone`): Gemma's layout plus query/key norms, and the
SigLIP vision tower of the multimodal presets."""

from __future__ import annotations

from collections.abc import Mapping

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import rule_table
from keras_hub_autodist.architectures.gemma import GEMMA_RULES
from keras_hub_autodist.architectures.gemma import GEMMA_SEQUENCE_PARALLEL_OUTPUTS
from keras_hub_autodist.errors import UnsupportedArchitectureError

_VIT = r"image_encoder/encoder_block_\d+/"
# The vision tower (`Gemma3VisionEncoder`, a ViT with fused-head 2D
# projections) and the projection of its tokens into the text model.
GEMMA3_VISION_RULES = rule_table(
    (_VIT + "multi_head_attention/(query|key|value)_proj/kernel", ("embed", "heads")),
    (_VIT + "multi_head_attention/(query|key|value)_proj/bias", ("heads",)),
    (_VIT + "multi_head_attention/out_proj/kernel", ("heads", "embed")),
    (_VIT + "mlp_dense_1/kernel", ("embed", "mlp")),
    (_VIT + "mlp_dense_1/bias", ("mlp",)),
    (_VIT + "mlp_dense_2/kernel", ("mlp", "embed")),
    (_VIT + "(multi_head_attention/out_proj|mlp_dense_2)/bias", ("norm",)),
    (r"image_encoder/.*layer_norm(_\d)?/(gamma|beta)", ("norm",)),
    (
        "image_encoder/encoder_embeddings/embedding_conv/kernel",
        ("unsharded",) * 3 + ("embed",),
    ),
    ("image_encoder/encoder_embeddings/embedding_conv/bias", ("norm",)),
    (
        "image_encoder/encoder_embeddings/position_embedding/embeddings",
        ("unsharded", "embed"),
    ),
    ("vision_output_encoder/vision_soft_embedding_norm/scale", ("norm",)),
    ("vision_output_encoder/vision_input_projection/kernel", ("unsharded", "embed")),
)


class Gemma3Architecture(Architecture):
    """Weights of a `Gemma3Backbone`, text-only or with its vision tower.

    Unlike Gemma 1/2, each gated MLP projection has `intermediate_dim`
    columns, and attention has `query_norm`/`key_norm` over `head_dim` when
    `use_query_key_norm` is set. The vision tower is tensor parallel like
    the decoder (heads of its fused projections, MLP columns). Embedding-model
    heads (`is_embedding_model=True`) are not supported.

    Example:
    >>> GEMMA3.check_config({"is_embedding_model": False})
    """

    name = "gemma3"
    rules = GEMMA_RULES + GEMMA3_VISION_RULES
    config_fields = DECODER_CONFIG_FIELDS
    sequence_parallel_outputs = GEMMA_SEQUENCE_PARALLEL_OUTPUTS

    def check_config(self, config: Mapping) -> None:
        if config.get("is_embedding_model", False):
            raise UnsupportedArchitectureError(
                "keras_hub_autodist does not plan Gemma 3 embedding models "
                "(`is_embedding_model=True`). Use a causal LM preset or your "
                "own layout map. Received: is_embedding_model=True"
            )


GEMMA3 = Gemma3Architecture()
