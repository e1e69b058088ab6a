"""The interface an architecture handler implements."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm")


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One weight of a backbone, as derived from its config.

    Args:
        path: the Keras variable path, e.g.
            `"decoder_block_0/attention/query/kernel"`.
        pattern: a regular expression matching this weight's path (and the
            same weight in every other layer) with `re.fullmatch`.
        shape: the weight's shape.
        axes: one logical axis per dimension, from `LOGICAL_AXES`.

    Example:
    >>> spec = WeightSpec("final_norm/scale", "final_norm/scale", (16,), ("norm",))
    >>> spec.shape, spec.axes
    ((16,), ('norm',))
    """

    path: str
    pattern: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(
                f"Weight {self.path!r} has shape {self.shape} but logical "
                f"axes {self.axes}; give one logical axis per dimension."
            )
        unknown = set(self.axes) - set(LOGICAL_AXES)
        if unknown:
            raise ValueError(
                f"Weight {self.path!r} uses unknown logical axes "
                f"{sorted(unknown)}; use those in {LOGICAL_AXES}."
            )


class Architecture:
    """Base class of an architecture handler.

    A handler turns a backbone config (the keyword arguments of the backbone
    class, as in a Keras preset's `config.json`) into the table of the
    backbone's weights. Subclasses set `name` and `config_fields` and
    implement `weights`.

    Example:
    ```python
    class MyFamily(Architecture):
        name = "my_family"
        config_fields = {"vocab": "vocabulary_size", "embed": "hidden_dim"}

        def weights(self, config):
            v, d = config["vocabulary_size"], config["hidden_dim"]
            return [global_weight("embedding/embeddings", (v, d), ("vocab", "embed"))]
    ```
    """

    name: str = ""
    # Logical axis → the config field whose value sets that dimension; used
    # to explain fallbacks ("num_key_value_heads=1 does not divide ...").
    config_fields: Mapping[str, str] = {}
    # Layer outputs on the residual stream, as `re.fullmatch` patterns of
    # `<layer path>/output` (the keys Keras looks up for a layer's output):
    # norms and the row-parallel projections (single tensors only: a
    # layout is applied to every tensor of a tuple output). Sequence
    # parallelism shards them on the sequence over the model axis; empty
    # means the family does not support it.
    sequence_parallel_outputs: tuple[str, ...] = ()

    def weights(self, config: Mapping) -> list[WeightSpec]:
        """Return every weight of the backbone built from `config`."""
        raise NotImplementedError

    def __repr__(self):
        return f"<{type(self).__name__} name={self.name!r}>"


def global_weight(path: str, shape: Sequence[int], axes: Sequence[str]) -> WeightSpec:
    """A weight that exists once in the model, matched by its exact path."""
    return WeightSpec(path, _escape(path), tuple(shape), tuple(axes))


def layer_weights(
    prefix: str,
    num_layers: int,
    entries: Sequence[tuple[str, Sequence[int], Sequence[str]]],
) -> list[WeightSpec]:
    """The weights of `num_layers` identical blocks named `{prefix}{i}/...`.

    Args:
        prefix: block name before its index, e.g. `"decoder_block_"`.
        num_layers: number of blocks.
        entries: `(path inside the block, shape, logical axes)` triples.
    """
    specs = []
    for index in range(num_layers):
        for sub_path, shape, axes in entries:
            specs.append(
                WeightSpec(
                    f"{prefix}{index}/{sub_path}",
                    rf"{_escape(prefix)}\d+/{_escape(sub_path)}",
                    tuple(shape),
                    tuple(axes),
                )
            )
    return specs


def _escape(text: str) -> str:
    # Paths hold letters, digits, "_" and "/"; only "." would need escaping.
    return text.replace(".", r"\.")
