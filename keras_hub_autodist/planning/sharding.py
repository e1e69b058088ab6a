"""Logical weight axes → mesh axes, with the fallback policy kept as data.

Architectures describe each weight with *logical* axes (`vocab`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `norm`, `expert`, and `unsharded` for
a dimension never sharded). The tables below turn them
into a mesh axis per dimension, for a strategy:

- `"tp"`: the model axis shards each weight's *parallel* dimension
  (Megatron: heads of query/key/value/output, MLP columns of gate/up and rows
  of down, vocabulary of the embeddings); the hidden axis, when the mesh has
  one, shards `embed`. Weights are replicated over the batch axis.
- `"fsdp"`: as `"tp"`, and the batch axis shards one more dimension of each
  weight (ZeRO-3 / MaxText-style fully sharded data parallelism).

When the preferred dimension does not divide by the axis size the next one in
`MODEL_FALLBACKS` is tried, else the weight is replicated over that axis. The
planner records each fallback with its reason.

Context parallelism: the context axis splits each sequence, so weights are
replicated over it under `"tp"`; under `"fsdp"` it shards one more free
dimension of each weight, as the batch axis does (ZeRO-3 over batch x
context). Activations follow the tokens (`context_activation_spec`); the
key/value projections run on each device's block of tokens
(`key_value_block_spec`), and attention gathers their outputs over the
axis.

Mixtures of experts: a weight with an `expert` dimension (one slice per
expert) puts its experts on the model axis when their count divides it
(expert parallelism; its `mlp` dimension then stays whole), else its `mlp`
dimension, as any MLP kernel (tensor parallelism inside each expert). A mesh
axis named `expert` takes the experts instead (`EXPERT_AXIS_FALLBACKS`), and
the model axis then splits each expert's `mlp`. Routers have no `expert`
dimension: their expert-count column is `unsharded`, so they are replicated
over the model and expert axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

STRATEGIES = ("tp", "fsdp")

# The logical axis that the model axis shards, first one present wins.
PARALLEL_AXES = ("vocab", "heads", "kv_heads", "mlp")

# For each parallel axis: the dimensions tried in order on the model axis.
MODEL_FALLBACKS = {
    "vocab": ("vocab", "embed"),
    "heads": ("heads", "head_dim"),
    "kv_heads": ("kv_heads", "head_dim"),
    "mlp": ("mlp", "embed"),
}

# Weights with an `expert` dimension, on a mesh without an expert axis: the
# model axis shards the experts first (expert parallelism), else the usual
# MLP dimensions.
EXPERT_MODEL_FALLBACKS = ("expert",) + MODEL_FALLBACKS["mlp"]

# On a mesh with an expert axis, it shards these, first free one that divides.
EXPERT_AXIS_FALLBACKS = ("expert", "mlp", "embed")

# The hidden (second model) axis shards these, in order.
HIDDEN_AXIS_PREFERENCE = ("embed",)

# The batch axis under "fsdp" shards the first of these that is still free
# and divides: the largest dimensions of a decoder first (vocabulary, MLP
# width, experts, hidden), norms last. With the activations pinned to the
# batch axis (`fsdp_activation_spec`), XLA then gathers each weight once per
# use. Measured on the bench's compiled Gemma step (4096 tokens, 8x1 mesh;
# the report shows only the layout kept): with `embed` first instead, XLA
# resharded activations around the embedding and MLP, 1.3x the temporaries
# of the ZeRO-3 reference.
FSDP_AXIS_PREFERENCE = (
    "vocab",
    "mlp",
    "expert",
    "embed",
    "head_dim",
    "heads",
    "kv_heads",
    "norm",
)


def sequence_parallel_spec(mesh_axes) -> tuple[str | None, ...] | None:
    """The layout of a `[batch, sequence, hidden]` activation under sequence
    parallelism, or `None` when the model axis has nothing to shard.

    Megatron-style sequence parallelism shards the activations that tensor
    parallelism replicates over the model axis (the residual stream: norms,
    dropout, residual adds) on their sequence dimension over that axis; the
    batch dimension stays on the batch axis.

    Example:
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> sequence_parallel_spec(resolve_mesh_axes({"batch": 2, "model": 4}))
    ('batch', 'model', None)
    """
    model_axis = mesh_axes.model_axis
    if model_axis is None or mesh_axes.size(model_axis) <= 1:
        return None
    return (mesh_axes.batch_axis, model_axis, None)


def context_activation_spec(mesh_axes) -> tuple[str | None, ...] | None:
    """The layout of a `[batch, sequence, hidden]` activation under context
    parallelism, or `None` when the mesh has no context axis of more than
    one device.

    The tokens of each sequence stay split over the context axis through
    every sequence-wise layer (norms, MLP, residual adds, logits), the batch
    over the batch axis.

    Example:
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> context_activation_spec(resolve_mesh_axes({"batch": 2, "context": 4}))
    ('batch', 'context', None)
    """
    context_axis = mesh_axes.context_axis
    if mesh_axes.size(context_axis) <= 1:
        return None
    return (mesh_axes.batch_axis, context_axis, None)


def key_value_block_spec(kernel, mesh_axes) -> tuple[str | None, ...]:
    """The layout of a key or value projection's output under context
    parallelism: each device's block of the sequence.

    The output of a projection is `[batch, sequence]` followed by the
    kernel's dimensions other than `embed` (the contracted one), e.g.
    `[batch, sequence, kv_heads, head_dim]`. Those keep the mesh axes the
    kernel has (the model axis on the heads), but for the batch and context
    axes, which `"fsdp"` puts on weights and which are gathered where a
    weight is used. Each device projects its own block of tokens; attention
    then all-gathers the (small) keys and values over the context axis, so
    that each device attends its block of queries to the whole sequence
    (MaxText's `all_gather` strategy). Pinning them whole instead made XLA
    gather the projections' (larger) input: 4x the bytes on a one-head
    Gemma (docs/benchmarks.md, context parallelism).

    Args:
        kernel: the key or value kernel's `Weight`, with its `spec`.
        mesh_axes: the plan's `MeshAxes`.

    Example:
    >>> from keras_hub_autodist.architectures.weight import Weight
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> axes = resolve_mesh_axes({"batch": 1, "context": 4, "model": 2})
    >>> kv = Weight("k", "k", (2, 16, 8), ("kv_heads", "embed", "head_dim"),
    ...     spec=("model", None, None))
    >>> key_value_block_spec(kv, axes)
    ('batch', 'context', 'model', None)
    """
    gathered = (mesh_axes.batch_axis, mesh_axes.context_axis)
    kept = tuple(
        None if axis in gathered else axis
        for logical, axis in zip(kernel.logical_axes, kernel.spec)
        if logical != "embed"
    )
    return (mesh_axes.batch_axis, mesh_axes.context_axis, *kept)


def fsdp_activation_spec(mesh_axes) -> tuple[str | None, ...] | None:
    """The layout of a `[batch, sequence, hidden]` residual-stream activation
    under `"fsdp"`, or `None` when the batch axis has one device.

    The batch dimension stays on the batch axis, so that the weights sharded
    over that axis are gathered where they are used, rather than the
    activations resharded to follow them.

    Example:
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> fsdp_activation_spec(resolve_mesh_axes({"batch": 2, "model": 4}))
    ('batch', None, None)
    """
    batch_axis = mesh_axes.batch_axis
    if mesh_axes.size(batch_axis) <= 1:
        return None
    return (batch_axis, None, None)


def parallel_axis(logical_axes: tuple[str | None, ...]) -> str | None:
    """The logical axis a weight is tensor-parallel over, if any.

    Example:
    >>> parallel_axis(("embed", "heads", "head_dim"))
    'heads'
    """
    for axis in PARALLEL_AXES:
        if axis in logical_axes:
            return axis
    return None


def _field(fields, logical, size):
    return f"{fields.get(logical, logical)}={size}"


def _fields_for(weight, config_fields):
    """The config fields that explain `weight`'s dimensions: for a weight
    with an `expert` dimension, `expert_<axis>` entries override `<axis>`
    (e.g. `expert_mlp: moe_intermediate_dim`)."""
    fields = dict(config_fields)
    if "expert" in weight.logical_axes:
        prefix = "expert_"
        fields.update(
            {
                k[len(prefix) :]: v
                for k, v in config_fields.items()
                if k.startswith(prefix)
            }
        )
    return fields


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A weight dimension that could not take the mesh axis it wanted.

    Args:
        weight: the variable path.
        dimension: the dimension that wanted the axis (`None` for fsdp,
            which takes any free dimension).
        wanted: its logical axis (`None` for fsdp).
        mesh_axis: the mesh axis, e.g. `"model"`.
        chosen: the logical axis sharded instead, or `None` (replicated
            over `mesh_axis`).
        chosen_dimension: the dimension sharded instead, or `None`.
        reason: why, e.g. `"num_key_value_heads=1 does not divide by
            model=2"`.
        chosen_label: the chosen dimension as `field=size`, for the text.
        policy: the planner's reason for this choice, when it compared
            alternatives (the key/value policy).

    Example:
    >>> f = Fallback("k", 0, "kv_heads", "model", None, None,
    ...     "num_key_value_heads=1 does not divide by model=2")
    >>> str(f)
    "num_key_value_heads=1 does not divide by model=2: replicated over 'model'"
    """

    weight: str
    dimension: int | None
    wanted: str | None
    mesh_axis: str
    chosen: str | None
    chosen_dimension: int | None
    reason: str
    chosen_label: str = ""
    policy: str = ""

    def __str__(self) -> str:
        if self.chosen is None:
            text = f"{self.reason}: replicated over '{self.mesh_axis}'"
        else:
            text = (
                f"{self.reason}: sharded {self.chosen_label} over "
                f"'{self.mesh_axis}' instead"
            )
        return f"{text} ({self.policy})" if self.policy else text


def _model_candidates(weight, mesh_axes, kv_fallback):
    if "expert" in weight.logical_axes and mesh_axes.size(mesh_axes.expert_axis) == 1:
        # Expert parallelism over the model axis, else tensor parallelism
        # inside each expert.
        return "expert", EXPERT_MODEL_FALLBACKS
    primary = parallel_axis(weight.logical_axes)
    if primary is None:
        return None
    if primary == "kv_heads" and kv_fallback == "replicate":
        return primary, (primary,)
    return primary, MODEL_FALLBACKS[primary]


def _expert_candidates(weight, mesh_axes, kv_fallback):
    return (
        ("expert", EXPERT_AXIS_FALLBACKS) if "expert" in weight.logical_axes else None
    )


def _hidden_candidates(weight, mesh_axes, kv_fallback):
    return ("embed", HIDDEN_AXIS_PREFERENCE) if "embed" in weight.logical_axes else None


def _batch_candidates(weight, mesh_axes, kv_fallback):
    # Fully sharded data parallelism takes any free dimension.
    return None, FSDP_AXIS_PREFERENCE


@dataclasses.dataclass(frozen=True)
class AxisRole:
    """One mesh axis role and the weight dimensions it may shard.

    Args:
        role: the `MeshAxes` role, `"model"`, `"expert"`, `"hidden"`,
            `"batch"` or `"context"`.
        strategies: the strategies under which it applies.
        candidates: `(weight, mesh_axes, kv_fallback) -> (wanted,
            logical axes in order)`, or `None` when the weight has nothing
            for this axis. `wanted` is the logical axis the role prefers
            (a fallback is noted when another is sharded), or `None` for any.
    """

    role: str
    strategies: tuple[str, ...]
    candidates: Callable


# The mesh axes in the order they are placed: each takes the first free
# dimension among its candidates that divides by its size.
AXIS_ROLES = (
    AxisRole("model", STRATEGIES, _model_candidates),
    AxisRole("expert", STRATEGIES, _expert_candidates),
    AxisRole("hidden", STRATEGIES, _hidden_candidates),
    AxisRole("batch", ("fsdp",), _batch_candidates),
    AxisRole("context", ("fsdp",), _batch_candidates),
)


def _free_dims(weight, spec, logical):
    return [
        d
        for d, name in enumerate(weight.logical_axes)
        if name == logical and not spec[d]
    ]


def _place(weight, spec, axis, size, wanted, candidates, fields, policy):
    """Put mesh axis `axis` on the first free dimension among `candidates`
    (logical axes, in order) that divides by `size`; the `Fallback` taken
    when that is not `wanted`, else `None`."""
    chosen = chosen_dim = None
    for logical in candidates:
        for dim in _free_dims(weight, spec, logical):
            if weight.shape[dim] % size == 0:
                chosen, chosen_dim = logical, dim
                break
        if chosen is not None:
            break
    if chosen is not None:
        spec[chosen_dim] = axis
    if wanted is None:
        if chosen is not None:
            return None
        reason = f"no free dimension of shape {weight.shape} divides by {axis}={size}"
        return Fallback(weight.path, None, None, axis, None, None, reason)
    if chosen == wanted:
        return None
    wanted_dim = weight.logical_axes.index(wanted)
    return Fallback(
        weight.path,
        wanted_dim,
        wanted,
        axis,
        chosen,
        chosen_dim,
        f"{_field(fields, wanted, weight.shape[wanted_dim])} does not divide "
        f"by {axis}={size}",
        "" if chosen is None else _field(fields, chosen, weight.shape[chosen_dim]),
        policy if wanted == "kv_heads" else "",
    )


def assign_mesh_axes(
    weight,
    mesh_axes,
    strategy: str,
    config_fields,
    *,
    kv_fallback: str = "replicate",
    kv_policy: str = "",
):
    """Choose a mesh axis (or `None`) for each dimension of `weight`.

    Each role of `AXIS_ROLES` that applies to the strategy and has more than
    one device places its axis in turn.

    Args:
        weight: a `Weight` with logical axes.
        mesh_axes: a `MeshAxes` telling axis names, sizes and roles.
        strategy: `"tp"` or `"fsdp"`.
        config_fields: logical axis → config field, to explain fallbacks.
        kv_fallback: what to do with key/value kernels whose heads don't
            divide the model axis: `"replicate"` or `"head_dim"`.
        kv_policy: why the planner chose `kv_fallback`, recorded on the
            key/value fallbacks.

    Returns:
        `(spec, fallbacks)`: a tuple of mesh axis names / `None` per
        dimension, and the `Fallback`s taken, each with its reason.

    Example:
    >>> from keras_hub_autodist.architectures.weight import Weight
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> kv = Weight("k", "k", (1, 16, 8), ("kv_heads", "embed", "head_dim"))
    >>> assign_mesh_axes(kv, resolve_mesh_axes({"batch": 1, "model": 2}),
    ...     "tp", {"kv_heads": "num_key_value_heads"})[0]
    (None, None, None)
    """
    spec = [None] * len(weight.shape)
    notes = []
    fields = _fields_for(weight, config_fields)
    for role in AXIS_ROLES:
        axis = getattr(mesh_axes, f"{role.role}_axis")
        size = mesh_axes.size(axis)
        if strategy not in role.strategies or axis is None or size == 1:
            continue
        found = role.candidates(weight, mesh_axes, kv_fallback)
        if found is None:
            continue
        wanted, candidates = found
        if wanted is not None and not _free_dims(weight, spec, wanted):
            continue
        note = _place(weight, spec, axis, size, wanted, candidates, fields, kv_policy)
        if note is not None:
            notes.append(note)
    return tuple(spec), notes
