"""The layout search's candidates: every mesh of the devices over the
`batch`, `model` and `context` axes (and `expert` for a mixture of
experts), each with the strategies and remats searched (`Candidate`); the
batches each is tried at are `batches`'.

Imports neither Keras nor JAX.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

# The strategies and rematerializations searched by default (`None`: off;
# the block policies of `remat_arguments.BLOCK_POLICIES`).
STRATEGIES = ("tp", "fsdp")
REMATS = (None, "dots", "full")


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
    """One layout of the step: a mesh, a strategy, remat, the global batch
    of one compiled step and how many of those steps accumulate their
    gradients into one update (equal to another of the same `key()`).

    Args:
        mesh: axis name -> size.
        strategy: `"tp"` or `"fsdp"`.
        remat: the rematerialization (`None`: off), as `remat=` takes it.
        batch_size: the sequences of one compiled (micro-)step over all
            devices: what `fit(batch_size=...)` is given.
        accumulation: the micro-steps whose gradients make one optimizer
            update (Keras' `gradient_accumulation_steps`; 1: none).
    """

    mesh: Mapping[str, int]
    strategy: str
    remat: str | Mapping | None
    batch_size: int
    accumulation: int = 1

    @property
    def per_device_batch(self) -> int:
        """The sequences each replica of the batch axis takes per step."""
        return -(-self.batch_size // self.mesh.get("batch", 1))

    def settings(self) -> dict:
        """What a user sets to run it, beside the mesh: the strategy,
        remat, the batch per device and per step (what `fit` is given) and
        the gradient accumulation steps."""
        return {
            "strategy": self.strategy,
            "remat": self.remat,
            "per_device_batch": self.per_device_batch,
            "batch_size": self.batch_size,
            "gradient_accumulation_steps": self.accumulation,
        }

    def label(self) -> str:
        """E.g. `batch=2,model=4 tp remat=full` (`accumulate=4` where the
        gradients of 4 micro-steps make one update)."""
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        remat = f" remat={self.remat}" if self.remat else ""
        steps = f" accumulate={self.accumulation}" if self.accumulation > 1 else ""
        return f"{mesh} {self.strategy}{remat}{steps}"

    def key(self) -> tuple:
        """What tells layouts apart: the mesh's axes of more than one
        device, the strategy, remat, the batch and the accumulation (the
        first three are the layout's family: `family()`)."""
        mesh = tuple(sorted((k, v) for k, v in self.mesh.items() if v > 1))
        return (
            mesh,
            self.strategy,
            remat_key(self.remat),
            self.batch_size,
            self.accumulation,
        )

    def family(self) -> tuple:
        """The layout without its batch: the mesh, the strategy and remat."""
        return self.key()[:3]

    def __eq__(self, other):
        return isinstance(other, Candidate) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())


def remat_key(remat) -> str | None:
    """A remat setting in a hashable form (a dict of `keras.RematScope`'s
    arguments as its sorted JSON).

    Example:
    >>> remat_key({"mode": "full"})
    '{"mode": "full"}'
    """
    if isinstance(remat, Mapping):
        return json.dumps(dict(remat), sort_keys=True, default=str)
    return remat


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending.

    Example:
    >>> divisors(8)
    [1, 2, 4, 8]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(
    devices: int,
    batch_size: int | None,
    sequence_length: int,
    experts: bool = False,
) -> list[dict[str, int]]:
    """The meshes of `devices` over `batch`, `model` and `context` (with
    `experts`, also `expert` in the model axis' place): a batch axis that
    divides `batch_size` (any with `None`), a context axis that divides the
    sequence. The largest batch axis first.

    Example:
    >>> meshes(4, 4, 8)[:2]
    [{'batch': 4, 'model': 1}, {'batch': 2, 'model': 2}]
    >>> meshes(4, 4, 8)[2]
    {'batch': 2, 'model': 1, 'context': 2}
    """
    found = []
    for batch in reversed(divisors(devices)):
        if batch_size is not None and batch_size % batch:
            continue
        rest = devices // batch
        for context in divisors(rest):
            if sequence_length % context:
                continue
            model = rest // context
            names = ("model",) + (("expert",) if experts and model > 1 else ())
            for name in names:
                mesh = {"batch": batch, name: model}
                if context > 1:
                    mesh["context"] = context
                found.append(mesh)
    return found


def candidates(
    devices: int,
    batch_size: int | None,
    sequence_length: int,
    *,
    strategies=STRATEGIES,
    remats=REMATS,
    experts: bool = False,
) -> list[Candidate]:
    """Every layout searched (`meshes` x strategies x remat); `"fsdp"`
    only where a batch axis has more than one device (else it is `"tp"`).
    `batch_size` `None`: a batch is chosen per layout later (0 here).

    Example:
    >>> len(candidates(2, 2, 16))  # 3 meshes x 3 remats; fsdp on batch=2 only
    12
    """
    found = []
    for mesh in meshes(devices, batch_size, sequence_length, experts):
        for strategy in strategies:
            if strategy == "fsdp" and mesh["batch"] == 1:
                continue
            for remat in remats:
                found.append(Candidate(mesh, strategy, remat, batch_size or 0))
    return found


__all__ = [
    "REMATS",
    "STRATEGIES",
    "Candidate",
    "candidates",
    "divisors",
    "meshes",
    "remat_key",
]
