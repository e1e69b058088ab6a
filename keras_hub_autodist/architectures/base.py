"""The interface an architecture (a family's rule table) implements."""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from collections.abc import Sequence

from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.verify import unplanned_weight_error
from keras_hub_autodist.verify import warn_unplanned
from keras_hub_autodist.weight import LOGICAL_AXES
from keras_hub_autodist.weight import Weight

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


# The record an architecture describes a weight with (path, pattern, shape,
# logical axes): the data path's one `Weight`, under the name plugins know.
WeightSpec = Weight


class Architecture:
    """An architecture: which logical axes each variable of a backbone has.

    An architecture is an ordered rule table (`rules`): each `Rule` maps the
    variable paths its pattern `re.fullmatch`es to one logical axis per
    dimension. Shapes are not stated: they come from the model itself, built
    abstractly from the preset's config (`abstract.model_variables`).
    Every variable must match exactly one rule.

    Create one as a value, or subclass to refuse configs (`check_config`)
    or to give a keras-free fast path (`shape_hints`).

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

    def shape_hints(self, config: Mapping) -> list[WeightSpec] | None:
        """Optional keras-free weight table for the CLI's fast path, or `None`.

        Tests check every hint against the abstract build of the model.
        """
        return None

    def matching_rules(self, path: str) -> list[Rule]:
        """The rules whose pattern `re.fullmatch`es `path`."""
        return [rule for rule in self.rules if re.fullmatch(rule.pattern, path)]

    def weights(
        self, config: Mapping, backbone_cls: type, *, strict: bool = True
    ) -> list[WeightSpec]:
        """Every variable of `backbone_cls` built from `config`, with the
        logical axes of the rule it matches.

        Args:
            config: the backbone's constructor arguments.
            backbone_cls: the keras-hub backbone class.
            strict: a variable that matches no rule is an error (`True`),
                or a warning and the variable stays replicated (`False`).

        Raises:
            UnplannedWeightError: a variable matches several rules, or (when
                `strict`) none.
        """
        from keras_hub_autodist.abstract import model_variables

        self.check_config(config)  # refuse before building anything
        return self.weights_from(
            model_variables(backbone_cls, config),
            config,
            backbone_cls.__name__,
            strict=strict,
        )

    def weights_from(
        self,
        variables,
        config: Mapping,
        backbone_class: str,
        *,
        strict: bool = True,
    ) -> list[WeightSpec]:
        """`weights()` for a model already built from `config`: its config
        checked (`check_config`), each variable given the logical axes of
        the rule it matches (`match_variables`).

        The one path from built variables to weights, for a fresh abstract
        build and for one read from the disk cache alike.

        Args:
            variables: the model's variables (`Weight`s of the abstract build, or
                any objects with `.path` and `.shape`).
            config: the backbone's constructor arguments they were built from.
            backbone_class: the backbone class name, for messages.
            strict: as for `weights()`.

        Example:
        ```python
        from keras_hub_autodist.abstract import stored_variables

        variables = stored_variables("LlamaBackbone", config)
        weights = LLAMA.weights_from(variables, config, "LlamaBackbone")
        ```
        """
        self.check_config(config)
        return self.match_variables(variables, backbone_class, strict=strict)

    def match_variables(
        self, variables, backbone_class: str, *, strict: bool = True
    ) -> list[WeightSpec]:
        """Each variable's rule, without the config check of `weights_from()`.

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
