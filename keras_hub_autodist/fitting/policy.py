"""Pure choices the planner makes by comparing laid-out alternatives.

- the key/value layout when key/value heads don't divide the model axis
  (`choose_kv_layout`, over `KV_LAYOUTS`);
- the strategy under `strategy="auto"` (`choose_strategy`);
- the mesh under `device_mesh="auto"` (`choose_mesh`).

Each takes numbers the planner computed in one pass over the weights and
returns the choice with a sentence saying why. Nothing here lays out a weight.
"""

from __future__ import annotations

import dataclasses

from keras_hub_autodist.fitting.device_memory import GIB
from keras_hub_autodist.words import counted

# Under strategy "auto", "tp" is chosen while parameters, gradients and the
# two Adam moments take at most this share of a device's memory; the rest is
# left for activations. (`LayoutPlan.fits` asks whether they fit at all.)
AUTO_TP_MEMORY_SHARE = 0.8

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
# steps against a hand-written Megatron layout with the bench's collective
# counter (bench/comms.py; its report shows only the layout kept): replicating
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
    gib = GIB
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


def leaves_room_for_activations(training_bytes: int, capacity: int) -> bool:
    """Whether weights, gradients and Adam state (`training_bytes`) leave
    `1 - AUTO_TP_MEMORY_SHARE` of a device's `capacity` for activations: the
    rule of `strategy="auto"` and `device_mesh="auto"`.

    Example:
    >>> leaves_room_for_activations(8 * GIB, 16 * GIB)
    True
    """
    return training_bytes <= AUTO_TP_MEMORY_SHARE * capacity


def _budget(capacity: int, source: str) -> str:
    return f"{AUTO_TP_MEMORY_SHARE:.0%} of {capacity / GIB:.1f} GiB ({source})"


def choose_strategy(
    tp_training_bytes: int, capacity: int, source: str, batch_axis_size: int
) -> tuple[str, str]:
    """The strategy `"auto"` picks, and why.

    `"tp"` while its weights, gradients and Adam state leave room for
    activations, or when the batch axis has one device (fsdp would shard
    nothing more); else `"fsdp"`.

    Args:
        tp_training_bytes: weights + gradients + Adam state per device under
            `"tp"`.
        capacity: bytes of memory per device.
        source: where `capacity` comes from, for the reason.
        batch_axis_size: devices on the batch axis.

    Example:
    >>> choose_strategy(30 * GIB, 16 * GIB, "given", 4)[0]
    'fsdp'
    """
    need = tp_training_bytes / GIB
    budget = _budget(capacity, source)
    if leaves_room_for_activations(tp_training_bytes, capacity):
        return "tp", (
            f"auto: weights+grads+Adam {need:.2f} GiB per device fit in {budget}"
        )
    if batch_axis_size == 1:
        return "tp", (
            f"auto: weights+grads+Adam need {need:.2f} GiB per device, over "
            f"{budget}; fsdp would shard nothing more on a batch axis of size 1"
        )
    return "fsdp", (
        f"auto: with tp, weights+grads+Adam need {need:.2f} GiB per device, "
        f"over {budget}"
    )


def mesh_candidates(
    num_devices: int, batch_size: int | None = None
) -> list[dict[str, int]]:
    """The `{"batch": b, "model": n // b}` meshes over `num_devices`, the
    largest batch axis first; with `batch_size`, only those whose batch axis
    divides it (a bound model would pad the batch to the batch axis, and
    compute the padded rows for nothing).

    Example:
    >>> mesh_candidates(4)
    [{'batch': 4, 'model': 1}, {'batch': 2, 'model': 2}, {'batch': 1, 'model': 4}]
    >>> mesh_candidates(4, batch_size=2)
    [{'batch': 2, 'model': 2}, {'batch': 1, 'model': 4}]
    """
    divisors = set()
    for small in range(1, int(num_devices**0.5) + 1):
        if num_devices % small == 0:
            divisors.update((small, num_devices // small))
    return [
        {"batch": batch, "model": num_devices // batch}
        for batch in sorted(divisors, reverse=True)
        if batch_size is None or batch_size % batch == 0
    ]


# How the reason of a mesh `device_mesh="auto"` chose begins: a plan whose
# `mesh_reason` does was planned for "auto", and planning it again with
# other options chooses again.
AUTO_MESH_REASON = "auto over "


def choose_mesh(
    tp_training_bytes: list[int],
    num_devices: int,
    capacity: int,
    source: str,
    batch_size: int | None = None,
) -> tuple[dict[str, int], str]:
    """The mesh `device_mesh="auto"` picks, and why.

    The largest batch axis (the least tensor parallelism) whose `"tp"`
    plan leaves room for activations, and that divides `batch_size` when
    one is given; if none does, every device on the model axis.

    Args:
        tp_training_bytes: weights + gradients + Adam state per device under
            `"tp"`, for each of `mesh_candidates(num_devices, batch_size)`
            in order.
        num_devices: how many devices the mesh spans.
        capacity: bytes of memory per device.
        source: where `capacity` comes from, for the reason.
        batch_size: the global batch of the training step planned for, or
            `None`.

    Example:
    >>> choose_mesh([8 * GIB, 4 * GIB], 2, 6 * GIB, "given")[0]
    {'batch': 1, 'model': 2}
    """
    dividing = "" if batch_size is None else f" that divides the batch of {batch_size}"
    candidates = mesh_candidates(num_devices, batch_size)
    for mesh, need in zip(candidates, tp_training_bytes):
        if leaves_room_for_activations(need, capacity):
            return mesh, (
                f"{AUTO_MESH_REASON}{counted(num_devices, 'device')}: the largest "
                f"batch axis"
                f"{dividing} whose tp plan fits {_budget(capacity, source)}"
            )
    return {"batch": 1, "model": num_devices}, (
        f"{AUTO_MESH_REASON}{counted(num_devices, 'device')}: no tp plan fits "
        f"{_budget(capacity, source)}, so every device is on the model axis"
    )
