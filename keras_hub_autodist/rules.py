"""Logical weight axes → mesh axes, with the fallback policy kept as data.

Architectures describe each weight with *logical* axes (`vocab`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `norm`, `expert`, and `unsharded` for
a dimension never sharded). The rules below turn them
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

# With grouped/multi-query attention whose key/value heads don't divide the
# model axis, key/value kernels are replicated over it (the Megatron choice:
# no collective beyond the query's) unless that plan does not fit the device
# memory, or breaks one of these per-device parameter targets, while sharding
# their head_dim does not. "tp": at most this factor x total bytes / model-axis
# size; "fsdp": at most this factor x total bytes / devices.
TP_DEVICE_BYTES_TARGET = 1.10
FSDP_DEVICE_BYTES_TARGET = 1.05


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """One way to lay out key/value kernels whose heads don't divide the
    model axis, for `choose_kv_layout` to compare.

    Args:
        kv_fallback: the `assign_mesh_axes` option that lays it out.
        label: how the plan names it, e.g. `"K/V replicated"`.
        collective_rank: its communication cost relative to the other
            layouts; lower moves fewer bytes.
        cost_note: why it moves the bytes it does.
        gerund: the layout as a reason's subject, e.g. `"replicating
            them"`.
    """

    kv_fallback: str
    label: str
    collective_rank: int
    cost_note: str
    gerund: str


# The alternatives, cheapest communication first. Measured on compiled train
# steps against a hand-written Megatron layout (issue 12's measurements; the
# bench's report compares only the layout the planner keeps): replicating
# K/V adds no collective beyond the query's; sharding their head_dim splits
# the attention contraction, whose partial scores and their gradients cross
# the model axis in every block (1.39x the bytes of replication for
# multi-query attention on 2x4, 1.08x for 2 key/value heads on a 4-way model
# axis).
KV_LAYOUTS = (
    KVLayout("replicate", "K/V replicated", 0, "fewer collectives", "replicating them"),
    KVLayout(
        "head_dim",
        "K/V sharded on head_dim",
        1,
        "attention scores reduced over the model axis in every block",
        "sharding their head_dim",
    ),
)


@dataclasses.dataclass(frozen=True)
class KVCandidate:
    """A `KVLayout` as planned: what it would hold per device.

    Args:
        layout: the `KVLayout`.
        training_bytes: weights, gradients and Adam state per device.
        ideal_ratio: per-device parameter bytes over the strategy's ideal
            (total / model-axis size for `"tp"`, total / devices for
            `"fsdp"`).
    """

    layout: KVLayout
    training_bytes: int
    ideal_ratio: float


def choose_kv_layout(
    candidates, *, capacity: int, target: float, strategy: str, axis: str
) -> tuple[KVLayout, str]:
    """The layout that moves the fewest bytes among those that fit.

    A candidate is acceptable when its weights, gradients and Adam state fit
    `capacity` bytes per device and its parameters stay within `target` x
    the ideal. The cheapest acceptable one wins; when none is acceptable,
    the cheapest that fits the memory; when none fits, the cheapest.

    Args:
        candidates: `KVCandidate`s, one per `KVLayout`.
        capacity: bytes of memory per device.
        target: the strategy's per-device parameter target.
        strategy: `"tp"` or `"fsdp"`, for the reason.
        axis: the model axis name, for the reason.

    Returns:
        `(layout, reason)`.

    Example:
    >>> replicate, head_dim = KV_LAYOUTS
    >>> layout, reason = choose_kv_layout(
    ...     [KVCandidate(replicate, 2**30, 1.02), KVCandidate(head_dim, 2**29, 1.0)],
    ...     capacity=16 * 2**30, target=1.10, strategy="tp", axis="model")
    >>> layout.kv_fallback, reason.split(":")[0]
    ('replicate', "K/V replicated over 'model'")
    """
    gib = 1024**3
    ranked = sorted(candidates, key=lambda c: c.layout.collective_rank)

    def fits(c):
        return c.training_bytes <= capacity

    acceptable = [c for c in ranked if fits(c) and c.ideal_ratio <= target]
    fitting = [c for c in ranked if fits(c)]
    chosen = (acceptable or fitting or ranked)[0]
    cheapest = ranked[0]
    where = f"'{axis}'"
    if chosen is cheapest:
        held = f"weights+grads+Adam {chosen.training_bytes / gib:.2f} GiB per device "
        return chosen.layout, (
            f"{chosen.layout.label} over {where}: {chosen.layout.cost_note}; "
            + held
            + (
                f"fit in {capacity / gib:.2f} GiB"
                if fits(chosen)
                else f"(neither K/V layout fits {capacity / gib:.2f} GiB)"
            )
        )
    rejected = cheapest.layout.gerund
    if not fits(cheapest):
        why = (
            f"{rejected} over {where} would need "
            f"{cheapest.training_bytes / gib:.2f} GiB > {capacity / gib:.2f} GiB "
            f"per device (weights+grads+Adam), sharded needs "
            f"{chosen.training_bytes / gib:.2f} GiB"
        )
    else:
        why = (
            f"{rejected} over {where} would hold {cheapest.ideal_ratio:.3f}x the "
            f"ideal per-device parameter bytes, over the {target:.2f}x "
            f"{strategy} target"
        )
    return chosen.layout, f"{chosen.layout.label}: {why}"


# Under strategy "auto", "tp" is chosen while parameters, gradients and the
# two Adam moments fit in this share of a device's memory; the rest is left
# for activations.
AUTO_TP_MEMORY_SHARE = 0.8

# Per-device memory assumed when the backend reports none (CPU, or planning
# for a mesh given as a mapping): 16 GiB, as on a T4 or a TPU v3 core.
# Override with `device_memory=` or $KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB.
DEFAULT_DEVICE_MEMORY_BYTES = 16 * 1024**3


def sequence_parallel_spec(mesh_axes) -> tuple[str | None, ...] | None:
    """The layout of a `[batch, sequence, hidden]` activation under sequence
    parallelism, or `None` when the model axis has nothing to shard.

    Megatron-style sequence parallelism shards the activations that tensor
    parallelism replicates over the model axis (the residual stream: norms,
    dropout, residual adds) on their sequence dimension over that axis; the
    batch dimension stays on the batch axis.

    Example:
    >>> from keras_hub_autodist.mesh import resolve_mesh_axes
    >>> sequence_parallel_spec(resolve_mesh_axes({"batch": 2, "model": 4}))
    ('batch', 'model', None)
    """
    model_axis = mesh_axes.model_axis
    if model_axis is None or mesh_axes.size(model_axis) <= 1:
        return None
    return (mesh_axes.batch_axis, model_axis, None)


def fsdp_activation_spec(mesh_axes) -> tuple[str | None, ...] | None:
    """The layout of a `[batch, sequence, hidden]` residual-stream activation
    under `"fsdp"`, or `None` when the batch axis has one device.

    The batch dimension stays on the batch axis, so that the weights sharded
    over that axis are gathered where they are used, rather than the
    activations resharded to follow them.

    Example:
    >>> from keras_hub_autodist.mesh import resolve_mesh_axes
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


def _dim_of(logical_axes, logical):
    try:
        return logical_axes.index(logical)
    except ValueError:
        return None


def _field(fields, logical, size):
    return f"{fields.get(logical, logical)}={size}"


def _fields_for(weight, config_fields):
    """The config fields that explain `weight`'s dimensions: for a weight
    with an `expert` dimension, `expert_<axis>` entries override `<axis>`
    (e.g. `expert_mlp: moe_intermediate_dim`)."""
    fields = dict(config_fields)
    if "expert" in weight.axes:
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


def _place(weight, spec, axis, size, candidates, wanted, fields, notes):
    """Put mesh axis `axis` on the first free dimension among `candidates`
    (logical axes, in order) that divides by `size`; note a fallback when
    that is not `wanted`."""
    chosen = None
    for logical in candidates:
        for dim, name in enumerate(weight.axes):
            if name == logical and spec[dim] is None and weight.shape[dim] % size == 0:
                spec[dim], chosen = axis, logical
                break
        if chosen is not None:
            break
    if chosen != wanted:
        wanted_dim = _dim_of(weight.axes, wanted)
        cause = (
            f"{_field(fields, wanted, weight.shape[wanted_dim])} does not divide "
            f"by {axis}={size}"
        )
        chosen_dim = None if chosen is None else spec.index(axis)
        notes.append(
            Fallback(
                weight.path,
                wanted_dim,
                wanted,
                axis,
                chosen,
                chosen_dim,
                cause,
                ""
                if chosen is None
                else _field(fields, chosen, weight.shape[chosen_dim]),
            )
        )
    return chosen


def assign_mesh_axes(
    weight,
    mesh_axes,
    strategy: str,
    config_fields,
    *,
    kv_fallback: str = "replicate",
):
    """Choose a mesh axis (or `None`) for each dimension of `weight`.

    Args:
        weight: a `WeightSpec`.
        mesh_axes: a `MeshAxes` telling axis names, sizes and roles.
        strategy: `"tp"` or `"fsdp"`.
        config_fields: logical axis → config field, to explain fallbacks.
        kv_fallback: what to do with key/value kernels whose heads don't
            divide the model axis: `"replicate"` or `"head_dim"`.

    Returns:
        `(spec, fallbacks)`: a tuple of mesh axis names / `None` per
        dimension, and the `Fallback`s taken, each with its reason.

    Example:
    >>> from keras_hub_autodist.architectures.base import WeightSpec
    >>> from keras_hub_autodist.mesh import resolve_mesh_axes
    >>> kv = WeightSpec("k", "k", (1, 16, 8), ("kv_heads", "embed", "head_dim"))
    >>> assign_mesh_axes(kv, resolve_mesh_axes({"batch": 1, "model": 2}),
    ...     "tp", {"kv_heads": "num_key_value_heads"})[0]
    (None, None, None)
    """
    spec = [None] * len(weight.shape)
    notes = []
    config_fields = _fields_for(weight, config_fields)

    def free_dims(order):
        for logical in order:
            for dim, name in enumerate(weight.axes):
                if name == logical and spec[dim] is None:
                    yield dim, logical

    model_axis, model_size = mesh_axes.model_axis, mesh_axes.size(mesh_axes.model_axis)
    expert_axis = getattr(mesh_axes, "expert_axis", None)
    expert_size = mesh_axes.size(expert_axis)
    experts = "expert" in weight.axes
    primary = parallel_axis(weight.axes)
    if experts and (expert_axis is None or expert_size == 1):
        # Expert parallelism over the model axis, else tensor parallelism
        # inside each expert.
        primary, candidates = "expert", EXPERT_MODEL_FALLBACKS
    elif primary is not None:
        candidates = MODEL_FALLBACKS[primary]
        if primary == "kv_heads" and kv_fallback == "replicate":
            candidates = ("kv_heads",)
    if model_axis is not None and model_size > 1 and primary is not None:
        _place(
            weight,
            spec,
            model_axis,
            model_size,
            candidates,
            primary,
            config_fields,
            notes,
        )

    if experts and expert_axis is not None and expert_size > 1:
        _place(
            weight,
            spec,
            expert_axis,
            expert_size,
            EXPERT_AXIS_FALLBACKS,
            "expert",
            config_fields,
            notes,
        )

    hidden_axis, hidden_size = (
        mesh_axes.hidden_axis,
        mesh_axes.size(mesh_axes.hidden_axis),
    )
    if hidden_axis is not None and hidden_size > 1:
        wanted = [(d, n) for d, n in free_dims(HIDDEN_AXIS_PREFERENCE)]
        placed = False
        for dim, _ in wanted:
            if weight.shape[dim] % hidden_size == 0:
                spec[dim], placed = hidden_axis, True
                break
        if wanted and not placed:
            dim, logical = wanted[0]
            notes.append(
                Fallback(
                    weight.path,
                    dim,
                    logical,
                    hidden_axis,
                    None,
                    None,
                    f"{_field(config_fields, logical, weight.shape[dim])} does "
                    f"not divide by {hidden_axis}={hidden_size}",
                )
            )

    batch_axis, batch_size = mesh_axes.batch_axis, mesh_axes.size(mesh_axes.batch_axis)
    if strategy == "fsdp" and batch_size > 1:
        placed = False
        for dim, _ in free_dims(FSDP_AXIS_PREFERENCE):
            if weight.shape[dim] % batch_size == 0:
                spec[dim], placed = batch_axis, True
                break
        if not placed:
            notes.append(
                Fallback(
                    weight.path,
                    None,
                    None,
                    batch_axis,
                    None,
                    None,
                    f"no free dimension of shape {weight.shape} divides by "
                    f"{batch_axis}={batch_size}",
                )
            )
    return tuple(spec), notes
