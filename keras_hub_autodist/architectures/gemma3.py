"""Gemma 3 text (`Gemma3Backbone`): Gemma's layout plus query/key norms."""

from __future__ import annotations

from collections.abc import Mapping

from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import WeightSpec
from keras_hub_autodist.architectures.base import layer_weights
from keras_hub_autodist.architectures.gemma import GEMMA_CONFIG_FIELDS
from keras_hub_autodist.architectures.gemma import GEMMA_RULES
from keras_hub_autodist.architectures.gemma import GEMMA_SEQUENCE_PARALLEL_OUTPUTS
from keras_hub_autodist.architectures.gemma import gemma_block_entries
from keras_hub_autodist.architectures.gemma import gemma_global_weights
from keras_hub_autodist.errors import UnsupportedArchitectureError


class Gemma3Architecture(Architecture):
    """Weights of a text-only `Gemma3Backbone`.

    Unlike Gemma 1/2, each gated MLP projection has `intermediate_dim`
    columns, and attention has `query_norm`/`key_norm` over `head_dim` when
    `use_query_key_norm` is set. Vision encoders and embedding-model heads
    are not supported.

    Example:
    >>> config = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
    ...     num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)
    >>> len(GEMMA3.shape_hints(config))
    13
    """

    name = "gemma3"
    rules = GEMMA_RULES
    config_fields = GEMMA_CONFIG_FIELDS
    sequence_parallel_outputs = GEMMA_SEQUENCE_PARALLEL_OUTPUTS

    def check_config(self, config: Mapping) -> None:
        if config.get("vision_encoder") is not None:
            raise UnsupportedArchitectureError(
                "keras_hub_autodist plans Gemma 3 text models only; this "
                "preset has a vision encoder. Load a text-only Gemma 3 preset "
                "(e.g. gemma3_1b) or use your own `ModelParallel` layout map. "
                "Received: vision_encoder="
                f"{type(config['vision_encoder']).__name__}"
            )
        if config.get("is_embedding_model", False):
            raise UnsupportedArchitectureError(
                "keras_hub_autodist does not plan Gemma 3 embedding models "
                "(`is_embedding_model=True`). Use a causal LM preset or your "
                "own layout map. Received: is_embedding_model=True"
            )

    def shape_hints(self, config: Mapping) -> list[WeightSpec]:
        self.check_config(config)
        entries = gemma_block_entries(config, config["intermediate_dim"])
        if config.get("use_query_key_norm", True):
            hd = config["head_dim"]
            entries += [
                ("attention/query_norm/scale", (hd,), ("norm",)),
                ("attention/key_norm/scale", (hd,), ("norm",)),
            ]
        return gemma_global_weights(config) + layer_weights(
            "decoder_block_", config["num_layers"], entries
        )


GEMMA3 = Gemma3Architecture()
