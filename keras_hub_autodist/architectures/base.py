"""The interface an architecture (a family's rule table) implements."""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from collections.abc import Sequence

from keras_hub_autodist.architectures.weight import LOGICAL_AXES
from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import UnplannedWeightWarning
from keras_hub_autodist.errors import option
from keras_hub_autodist.errors import warn

# The config fields behind each logical axis, for fallback notes
# ("num_key_value_heads=1 does not divide ..."): keras-hub's decoder
# backbones name their sizes alike, so a family states only what differs,
# e.g. `{**DECODER_CONFIG_FIELDS, "expert": "num_experts"}`. An
# `expert_<axis>` entry names the field of `<axis>` in expert kernels
# (`"expert_mlp": "moe_intermediate_dim"`). Families that derive the head
# size (hidden_dim // num_query_heads) have no `head_dim` field: the notes
# then say `head_dim=<size>` all the same.
DECODER_CONFIG_FIELDS = types.MappingProxyType(
    {
        "vocab": "vocabulary_size",
        "embed": "hidden_dim",
        "heads": "num_query_heads",
        "kv_heads": "num_key_value_heads",
        "head_dim": "head_dim",
        "mlp": "intermediate_dim",
    }
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One line of an architecture's rule table: variable paths → logical axes.

    Args:
        pattern: a regular expression that `re.fullmatch`es the Keras
            variable paths it covers, e.g.
            `r"decoder_block_\\d+/attention/(key|value)/kernel"`.
        axes: one logical axis (from `LOGICAL_AXES`) per dimension of those
            variables. No shapes: they come from the model.

    Example:
    >>> Rule(r"final_norm/scale", ("norm",)).axes
    ('norm',)
    """

    pattern: str
    axes: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        unknown = set(self.axes) - set(LOGICAL_AXES)
        if unknown:
            raise ValueError(
                f"Rule {self.pattern!r} uses unknown logical axes "
                f"{sorted(unknown)}; use those in {LOGICAL_AXES}."
            )
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ValueError(
                f"Rule pattern {self.pattern!r} is not a valid regular "
                f"expression: {error}"
            ) from error


def rule_table(*entries: tuple[str, Sequence[str]]) -> tuple[Rule, ...]:
    """An ordered rule table from `(pattern, logical axes)` pairs.

    Example:
    >>> table = rule_table(("token_embedding/embeddings", ("vocab", "embed")))
    >>> table[0].pattern
    'token_embedding/embeddings'
    """
    return tuple(Rule(pattern, tuple(axes)) for pattern, axes in entries)


# Rows most keras-hub decoders share, for families to build their tables
# from: `rule_table(*embedding_rules(), *attention_rules(...), ...)`.
EMBEDDING_RULES = (
    ("token_embedding/embeddings", ("vocab", "embed")),
    # Untied models only: the output projection.
    ("token_embedding/reverse_embeddings", ("embed", "vocab")),
)
# Where an attention layer puts the hidden dimension in its query/key/value
# kernels: first (Llama and most others), or after the heads (Gemma).
_ATTENTION_KERNEL_AXES = {
    "hidden_first": (("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")),
    "heads_first": (("heads", "embed", "head_dim"), ("kv_heads", "embed", "head_dim")),
}


def attention_rules(attention: str, kernels: str = "hidden_first") -> tuple:
    r"""The rows of the query, key/value and output kernels of the attention
    layers whose paths `attention` matches.

    Args:
        attention: a pattern of the attention layers' paths, e.g.
            `r"transformer_layer_\d+/self_attention"`.
        kernels: `"hidden_first"` for `(hidden, heads, head_dim)` query
            kernels, `"heads_first"` for `(heads, hidden, head_dim)`.

    Example:
    >>> attention_rules("layer/attention")[1]
    ('layer/attention/(key|value)/kernel', ('embed', 'kv_heads', 'head_dim'))
    """
    query, key_value = _ATTENTION_KERNEL_AXES[kernels]
    return (
        (f"{attention}/query/kernel", query),
        (f"{attention}/(key|value)/kernel", key_value),
        (f"{attention}/attention_output/kernel", ("heads", "head_dim", "embed")),
    )


def gated_mlp_rules(gate_and_up: str, down: str) -> tuple:
    """The rows of a gated MLP: the gate and up projections (`gate_and_up`
    matches both kernels' paths) into the MLP width, the down projection
    (`down`) back.

    Example:
    >>> gated_mlp_rules("mlp/(gate|up)/kernel", "mlp/down/kernel")[1]
    ('mlp/down/kernel', ('mlp', 'embed'))
    """
    return ((gate_and_up, ("embed", "mlp")), (down, ("mlp", "embed")))


class Architecture:
    """An architecture: which logical axes each variable of a backbone has.

    An architecture is an ordered rule table (`rules`): each `Rule` maps the
    variable paths its pattern `re.fullmatch`es to one logical axis per
    dimension. Shapes are not stated: they come from the model itself, built
    abstractly from the preset's config (`abstract.model_variables`).
    Every variable must match exactly one rule.

    Create one as a value, or subclass to refuse configs (`check_config`).

    Args:
        name: the family name shown in plans, e.g. `"qwen"`.
        rules: the rule table (`rule_table(...)`).
        config_fields: logical axis → the config field that sets it, to
            explain fallbacks ("num_key_value_heads=1 does not divide ...").
        sequence_parallel_outputs: `re.fullmatch` patterns of the
            residual-stream layer outputs (`<layer path>/output`) that
            sequence parallelism shards on the sequence; empty when the
            family does not support it.

    Example:
    ```python
    MY_FAMILY = Architecture(
        name="my_family",
        rules=rule_table(
            ("embedding/embeddings", ("vocab", "embed")),
            (r"block_\\d+/attention/(query|key|value)/kernel",
             ("embed", "heads", "head_dim")),
            (r"block_\\d+/attention/output/kernel", ("heads", "head_dim", "embed")),
            (r"block_\\d+/mlp/(gate|up)/kernel", ("embed", "mlp")),
            (r"block_\\d+/mlp/down/kernel", ("mlp", "embed")),
            (r".*norm/scale", ("norm",)),
        ),
    )
    ```
    """

    name: str = ""
    rules: tuple[Rule, ...] = ()
    config_fields: Mapping[str, str] = {}
    sequence_parallel_outputs: tuple[str, ...] = ()

    def __init__(
        self,
        name: str | None = None,
        rules: Sequence[Rule] | None = None,
        config_fields: Mapping[str, str] | None = None,
        sequence_parallel_outputs: Sequence[str] | None = None,
    ):
        # Only what is given overrides the class attributes, so a subclass
        # keeps its own name and table.
        if name is not None:
            self.name = name
        if rules is not None:
            self.rules = tuple(rules)
        if config_fields is not None:
            self.config_fields = dict(config_fields)
        if sequence_parallel_outputs is not None:
            self.sequence_parallel_outputs = tuple(sequence_parallel_outputs)

    def check_config(self, config: Mapping) -> None:
        """Refuse configs this family can't plan (raise an `AutodistError`)."""

    def matching_rules(self, path: str) -> list[Rule]:
        """The rules whose pattern `re.fullmatch`es `path`."""
        return [rule for rule in self.rules if re.fullmatch(rule.pattern, path)]

    def match_variables(
        self, variables, backbone_class: str, *, strict: bool = True
    ) -> list[Weight]:
        """Each variable with the logical axes of the one rule it matches.

        The one path from built variables to weights, for a fresh abstract
        build and for one read from the disk cache alike.

        Args:
            variables: objects with `.path` and `.shape`.
            backbone_class: the backbone class name, for messages.
            strict: as for `weights()`.
        """
        variables = list(variables)
        paths = {variable.path for variable in variables}
        specs, unmatched, ambiguous = [], [], {}
        for variable in variables:
            if _is_quantization_scale(variable.path, paths):
                # int8/int4 scales of a planned weight: small, replicated.
                specs.append(_replicated(variable))
                continue
            rules = self.matching_rules(variable.path)
            if len(rules) == 1:
                rule = rules[0]
                if len(rule.axes) != len(variable.shape):
                    raise _rank_error(self, backbone_class, rule, variable)
                shape = tuple(variable.shape)
                specs.append(Weight(variable.path, rule.pattern, shape, rule.axes))
            elif rules:
                ambiguous[variable.path] = [rule.pattern for rule in rules]
            else:
                unmatched.append(variable)
                specs.append(_replicated(variable))
        unmatched = [f"{v.path} {tuple(v.shape)}" for v in unmatched]
        if ambiguous or (unmatched and strict):
            raise unplanned_weight_error(
                backbone_class, self.name, unmatched, ambiguous
            )
        if unmatched:
            warn_unplanned(backbone_class, self.name, unmatched)
        return specs

    def __repr__(self):
        return f"<{type(self).__name__} name={self.name!r}>"


def _is_quantization_scale(path: str, paths) -> bool:
    """`.../kernel_scale` (or `embeddings_scale`, ...) beside its weight."""
    return path.endswith("_scale") and path[: -len("_scale")] in paths


def _replicated(variable) -> Weight:
    return Weight(
        variable.path,
        re.escape(variable.path),
        tuple(variable.shape),
        ("unsharded",) * len(variable.shape),
    )


def _rank_error(architecture, backbone_class, rule, variable):
    return UnplannedWeightError(
        f"The rule {rule.pattern!r} of the {architecture.name!r} architecture "
        f"gives {len(rule.axes)} logical axes {rule.axes}, but "
        f"{backbone_class} builds {variable.path!r} with shape "
        f"{variable.shape}. Fix the rule table (one logical axis per "
        f"dimension). Received: {variable.path} {variable.shape}"
    )


DOCS_ADDING_AN_ARCHITECTURE = "docs/architectures.md#adding-an-architecture"


def unplanned_weight_error(
    backbone_class: str,
    architecture: str,
    unmatched: list[str],
    ambiguous: dict[str, list[str]],
    *,
    planned_from: str = "",
) -> UnplannedWeightError:
    """The error for weights that match no rule of their architecture's
    table (`unmatched`, as `"path shape"`) or several (`ambiguous`: path →
    the patterns it matches), on the abstract build and on the loaded model.

    Example:
    >>> error = unplanned_weight_error("GemmaBackbone", "gemma", ["x (2,)"], {})
    >>> str(error).split(":")[0]
    "1 weights of GemmaBackbone match no rule of the 'gemma' architecture"
    """
    source = f" (planned from {planned_from})" if planned_from else ""
    parts = []
    if unmatched:
        parts.append(
            f"{len(unmatched)} weights of {backbone_class} match no rule of "
            f"the {architecture!r} architecture{source}: "
            + ", ".join(unmatched[:10])
            + ". Add a rule for them to the architecture's table (see "
            f"{DOCS_ADDING_AN_ARCHITECTURE}), or pass "
            f"{option('strict', 'False')} to keep them replicated"
        )
    if ambiguous:
        listed = "; ".join(
            f"{path} matches {patterns}"
            for path, patterns in list(ambiguous.items())[:5]
        )
        parts.append(
            f"{len(ambiguous)} weights of {backbone_class} match several "
            f"rules of the {architecture!r} architecture{source} ({listed}). "
            "Make the rules disjoint"
        )
    return UnplannedWeightError(
        ". ".join(parts)
        + f". Received: {len(unmatched)} unmatched, {len(ambiguous)} ambiguous"
    )


def warn_unplanned(backbone_class: str, architecture: str, unmatched) -> None:
    """Warn (`UnplannedWeightWarning`) that `unmatched` weights (`"path
    shape"`) stay replicated because `strict=False`."""
    warn(
        f"keras_hub_autodist: {len(unmatched)} weights of {backbone_class} "
        f"match no rule of the {architecture!r} architecture and stay "
        f"replicated on every device (strict=False): {', '.join(unmatched[:10])}",
        UnplannedWeightWarning,
    )
