"""The Keras distribution a plan runs under.

A plan without a context axis runs under Keras' own `ModelParallel`. With a
context axis of more than one device it runs under `ContextParallel`, a
`ModelParallel` that also splits the tokens of each sequence (dimension 1 of
every batch tensor) over that axis. Decoding (`generate`) treats the context
axis as replicated: its one-token steps have no sequence to split, so its
prompts are split on the batch axis alone and no layer output is pinned.

On a context mesh attention takes XLA's path, never a fused kernel: XLA
can't split cuDNN's flash attention or TPU's splash attention along the
sequence (JAX's cuDNN partitioning refuses a query split on the sequence; a
Pallas kernel is a custom call run on gathered inputs), while XLA's own
attention splits like every other op. Keras' check for a fused kernel
answers no inside a `ContextParallel` scope: a property of the layout, not a
choice of kernel. Which kernel each attention layer of a model runs, and its
installation, is the attention stage's (`keras_hub_autodist.attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.planning.step_shape import sequence_length_error

# Set while a bound model decodes (`generate`).
_DECODING = contextvars.ContextVar("keras_hub_autodist_decoding", default=False)


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Run the block as decoding: the context axis is not split.

    Example:
    >>> with decoding():
    ...     _DECODING.get()
    True
    """
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


def is_decoding() -> bool:
    """Whether this thread is decoding (`decoding()`)."""
    return _DECODING.get()


class ContextParallel(keras.distribution.ModelParallel):
    """`ModelParallel` that splits each sequence over a context axis.

    Batch tensors of rank 2 or more (`token_ids`, `padding_mask`, labels,
    sample weights, hidden states) are laid out `(batch axis, context axis,
    ...)`: dimension 1 is the sequence. The layer outputs the plan pins
    (`LayoutPlan.activation_layouts`) keep the tokens split through the
    model and gather the keys and values for attention.

    Args:
        context_dim_name: the context axis.
        **arguments: `keras.distribution.ModelParallel`'s.
    """

    def __init__(self, *, context_dim_name: str, **arguments):
        super().__init__(**arguments)
        self.context_dim_name = context_dim_name

    @property
    def context_size(self) -> int:
        mesh = self.device_mesh
        return mesh.shape[mesh.axis_names.index(self.context_dim_name)]

    def get_data_layout(self, data_shape):
        layout = super().get_data_layout(data_shape)
        if len(data_shape) < 2 or _DECODING.get():
            return layout
        length = data_shape[1]
        if length is not None and length % self.context_size:
            mesh = self.device_mesh
            raise sequence_length_error(
                dict(zip(mesh.axis_names, mesh.shape)),
                self.batch_dim_name,
                self.context_dim_name,
                length,
                change="a sequence length (the preprocessor's `sequence_length`)",
                received=f"a batch of shape {tuple(data_shape)}",
            )
        axes = list(layout.axes)
        axes[1] = self.context_dim_name
        return keras.distribution.TensorLayout(axes, self.device_mesh)

    def get_tensor_layout(self, path):
        if _DECODING.get():
            return None
        return super().get_tensor_layout(path)

    @contextlib.contextmanager
    def scope(self):
        with (
            super().scope(),
            compat.patched({"flash_attention_check": _no_flash_in_context_scope}),
        ):
            yield


def _no_flash_in_context_scope(can_use_flash_attention):
    """Keras' check whether a fused attention kernel can run, answering no
    while this thread is inside a `ContextParallel` scope."""

    @functools.wraps(can_use_flash_attention)
    def check(*args, **kwargs):
        if isinstance(keras.distribution.distribution(), ContextParallel):
            return False
        return can_use_flash_attention(*args, **kwargs)

    return check


def plan_distribution(plan, device_mesh) -> keras.distribution.ModelParallel:
    """The distribution `plan` runs under on `device_mesh`.

    Args:
        plan: a `LayoutPlan` (or `PlanRecord`).
        device_mesh: a `keras.distribution.DeviceMesh` of the planned shape.

    Returns:
        `ContextParallel` when the plan's mesh has a context axis of more
        than one device, else `keras.distribution.ModelParallel`.
    """
    arguments = dict(
        layout_map=plan.layout_map(device_mesh),
        batch_dim_name=plan.batch_axis,
        # Each process feeds its process-local batch (docs/multihost.md).
        auto_shard_dataset=False,
    )
    if context_parallel(plan):
        return ContextParallel(context_dim_name=plan.context_axis, **arguments)
    return keras.distribution.ModelParallel(**arguments)


def context_parallel(plan) -> bool:
    """Whether `plan`'s mesh has a context axis of more than one device."""
    return plan.mesh_axes.size(plan.context_axis) > 1
