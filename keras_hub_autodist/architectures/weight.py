"""`Weight`: the one record that describes a weight through the data path.

The abstract build gives its path, shape and dtype; the architecture's rule
table adds its layout-map key (`pattern`) and logical axes; the planner adds
its mesh axes (`spec`), the fallbacks it took and how many shards it is cut
into. Each step returns a changed copy (`dataclasses.replace`), never
mutates one.
"""

from __future__ import annotations

import dataclasses
import math

from keras_hub_autodist.errors import warn
from keras_hub_autodist.reading.dtypes import itemsize

LOGICAL_AXES = (
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "norm",
    "expert",
    "unsharded",
)


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight of a model, as far as the data path has described it.

    Args:
        path: the Keras variable path, e.g.
            `"decoder_block_0/attention/query/kernel"`.
        pattern: the layout-map key (a regex for `re.fullmatch`) that covers
            this weight, and the same weight of every other layer; `""` until
            a rule is matched.
        shape: the weight's shape.
        logical_axes: one logical axis (from `LOGICAL_AXES`) per dimension;
            empty until a rule is matched (`axes` is its deprecated name).
        dtype: the variable dtype, e.g. `"bfloat16"` (the plan's dtype once
            planned).
        spec: the mesh axis (or `None`) of each dimension; empty until
            planned.
        fallbacks: the `sharding.Fallback`s the planner took for it.
        shards: how many pieces the spec cuts it into (devices that hold
            distinct slices).

    Example:
    >>> w = Weight("final_norm/scale", "final_norm/scale", (16,), ("norm",), "float32")
    >>> w.bytes, w.logical_axes
    (64, ('norm',))
    """

    path: str
    pattern: str = ""
    shape: tuple[int, ...] = ()
    logical_axes: tuple[str, ...] = ()
    dtype: str = ""
    spec: tuple[str | None, ...] = ()
    fallbacks: tuple = ()
    shards: int = 1

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "logical_axes", tuple(self.logical_axes))
        axes = self.logical_axes
        if axes and len(self.shape) != len(axes):
            raise ValueError(
                f"Weight {self.path!r} has shape {self.shape} but logical "
                f"axes {axes}; give one logical axis per dimension."
            )
        unknown = set(axes) - set(LOGICAL_AXES)
        if unknown:
            raise ValueError(
                f"Weight {self.path!r} uses unknown logical axes "
                f"{sorted(unknown)}; use those in {LOGICAL_AXES}."
            )

    @property
    def axes(self) -> tuple[str, ...]:
        """Deprecated name of `logical_axes`."""
        warn(
            "`Weight.axes` is deprecated; use `Weight.logical_axes`.",
            DeprecationWarning,
        )
        return self.logical_axes

    @property
    def bytes(self) -> int:
        """The weight's total size in bytes, in its dtype."""
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def device_bytes(self) -> int:
        """The bytes each device holds (every axis divides its dimension)."""
        return self.bytes // self.shards

    @property
    def note(self) -> str:
        """The fallbacks as text, with their reasons (`""` if none)."""
        return "; ".join(str(fallback) for fallback in self.fallbacks)
