"""The Keras distribution a plan runs under.

A plan without a context axis runs under Keras' own `ModelParallel`. With a
context axis of more than one device it runs under `ContextParallel`, a
`ModelParallel` that also splits the tokens of each sequence (dimension 1 of
every batch tensor) over that axis. Decoding (`generate`) treats the context
axis as replicated: its one-token steps have no sequence to split, so its
prompts are split on the batch axis alone and no layer output is pinned.

Inside its scope Keras' attention takes XLA's path, never a fused kernel:
XLA can't split cuDNN's flash attention or TPU's splash attention along the
sequence (JAX's cuDNN partitioning refuses a query split on the sequence; a
Pallas kernel is a custom call run on gathered inputs), while XLA's own
attention splits like every other op. `training.binding` turns keras-hub's
own choice of a fused kernel off the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.errors import SequenceLengthError

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


class ContextParallel(keras.distribution.ModelParallel):
    """`ModelParallel` that splits each sequence over a context axis.

    Batch tensors of rank 2 or more (`token_ids`, `padding_mask`, labels,
    sample weights, hidden states) are laid out `(batch axis, context axis,
    ...)`: dimension 1 is the sequence. The layer outputs the plan pins
    (`LayoutPlan.activation_layouts`) keep the tokens split through the
    model and gather the keys and values for attention.

    Args:
        layout_map: the plan's `keras.distribution.LayoutMap`.
        batch_dim_name: the batch axis.
        context_dim_name: the context axis.
    """

    def __init__(self, *, layout_map, batch_dim_name: str, context_dim_name: str):
        super().__init__(
            layout_map=layout_map,
            batch_dim_name=batch_dim_name,
            # Each process feeds its process-local batch (docs/multihost.md).
            auto_shard_dataset=False,
        )
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
            raise SequenceLengthError(
                f"The context axis {self.context_dim_name!r} splits each "
                f"sequence over {self.context_size} devices, but a batch has "
                f"{length} tokens per sequence. Use a sequence length that is "
                f"a multiple of {self.context_size} (the preprocessor's "
                "`sequence_length`), or a mesh whose context axis divides it. "
                f"Received: a batch of shape {tuple(data_shape)}"
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
    layout_map = plan.layout_map(device_mesh)
    context_axis = plan.mesh_axes.context_axis
    if plan.mesh_axes.size(context_axis) > 1:
        return ContextParallel(
            layout_map=layout_map,
            batch_dim_name=plan.batch_axis,
            context_dim_name=context_axis,
        )
    return keras.distribution.ModelParallel(
        layout_map=layout_map,
        batch_dim_name=plan.batch_axis,
        # Each process feeds its process-local batch (docs/multihost.md).
        auto_shard_dataset=False,
    )
