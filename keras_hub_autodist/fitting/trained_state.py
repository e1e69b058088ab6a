"""What a training step trains and what its optimizer keeps beside the
weights: the optimizers' slots, the kernels LoRA adds and trains, the
weights that are never trained, and the state bytes these make.

The closed form (`step_memory`), the compiled check (`compiled_step`, which
builds the Keras optimizer named here) and the planner's choice of a
strategy (`state_need`) count the state from these.
"""

from __future__ import annotations

import dataclasses
import math

from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.reading.dtypes import itemsize


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An `optimizer=` name: its slots and the Keras optimizer it stands for.

    Args:
        slots: tensors kept per trainable weight, besides the weight and its
            gradient.
        keras_class: the `keras.optimizers` class the compiled check builds.
        keras_kwargs: its arguments.
    """

    slots: int
    keras_class: str
    keras_kwargs: tuple = ()


# The one table of optimizers: the estimate counts `slots`, the compiled
# check builds `keras_class(**keras_kwargs)`, the CLI offers the names.
OPTIMIZERS = {
    "adam": Optimizer(2, "Adam"),
    "sgd": Optimizer(0, "SGD"),
    "sgd_momentum": Optimizer(1, "SGD", (("momentum", 0.9),)),
}
# The layers keras-hub's `enable_lora()` adapts (`Backbone.default_lora_layer_names`):
# the query and value projections of attention. Each kernel of shape
# `(*inputs, out)` gains `lora_kernel_a` `(*inputs, r)` and `lora_kernel_b`
# `(r, out)`, which alone are trained, laid out as the kernel's `inputs` and
# `out` dimensions are (`PlanRecord.weight_layouts`).
LORA_LAYERS = ("query", "value", "query_dense", "value_dense")
# Keras' `enable_lora` creates its kernels in float32, whatever the layer's
# dtype (keras/src/layers/core/einsum_dense.py and dense.py).
LORA_DTYPE = "float32"
# Weight dtypes that are never trained: quantized kernels are frozen and
# trained only through LoRA.
FROZEN_DTYPES = ("int8", "uint8", "int4", "float8_e4m3fn", "float8_e5m2")


def optimizer_spec(optimizer: str) -> Optimizer:
    """The `Optimizer` of a name of `OPTIMIZERS`.

    Example:
    >>> optimizer_spec("adam").slots
    2
    """
    if optimizer not in OPTIMIZERS:
        raise PlanError(
            f"Unknown optimizer for the memory estimate. Use one of "
            f"{sorted(OPTIMIZERS)}. Received: optimizer={optimizer!r}"
        )
    return OPTIMIZERS[optimizer]


def is_lora_target(path: str) -> bool:
    """Whether `enable_lora()` adapts the kernel at `path`.

    Example:
    >>> is_lora_target("decoder_block_0/attention/query/kernel")
    True
    """
    parts = path.split("/")
    return len(parts) >= 2 and parts[-1] == "kernel" and parts[-2] in LORA_LAYERS


def lora_parameters(rows, lora_rank: int, mesh_axes=None) -> int:
    """Parameters of the LoRA kernels `enable_lora(lora_rank)` adds to `rows`:
    on the device holding the most of them, split as the plan's rows are
    over `mesh_axes`; whole without it.

    Example:
    ```python
    lora_parameters(plan.rows, 4)  # whole
    lora_parameters(plan.rows, 4, plan.mesh_axes)  # per device
    ```
    """

    def per_device(size, spec):
        if mesh_axes is None:
            return size
        return -(-size // math.prod(mesh_axes.size(axis) for axis in spec))

    return sum(
        lora_rank
        * (
            per_device(math.prod(row.shape[:-1]), row.spec[:-1])
            + per_device(row.shape[-1], row.spec[-1:])
        )
        for row in rows
        if is_lora_target(row.path)
    )


def trainable_bytes(
    rows, dtype: str, lora_rank: int | None, per_device, mesh_axes=None
) -> int:
    """Bytes of the trained weights on one device.

    With LoRA, the LoRA kernels alone, in `LORA_DTYPE`, split over
    `mesh_axes` as their kernels are (whole without it: an upper bound of a
    few MiB); otherwise every weight but quantized ones, as
    `per_device(row)` counts it. `dtype` is the model's.
    """
    if lora_rank is not None:
        return lora_parameters(rows, lora_rank, mesh_axes) * itemsize(LORA_DTYPE)
    return sum(per_device(row) for row in rows if row.dtype not in FROZEN_DTYPES)


def state_bytes(weights: int, trainable: int, optimizer: str = "adam") -> int:
    """Weights, gradients and optimizer slots: one gradient and `slots`
    tensors per trained byte on top of the weights held.

    Example:
    >>> state_bytes(100, 100, "adam")
    400
    >>> state_bytes(100, 1, "adam")
    103
    """
    return weights + (1 + optimizer_spec(optimizer).slots) * trainable


def state_need(rows, dtype: str, lora_rank: int | None, held: int) -> int:
    """Weights, gradients and Adam state per device of a layout holding
    `held` parameter bytes of `rows`: with LoRA of rank `lora_rank` only its
    kernels train (and are held on top); otherwise every weight, sharded as
    the weights are.

    Example:
    >>> state_need([], "float32", None, 100)
    400
    """
    if lora_rank is None:
        return state_bytes(held, held, "adam")
    trained = trainable_bytes(rows, dtype, lora_rank, None)
    return state_bytes(held + trained, trained, "adam")
