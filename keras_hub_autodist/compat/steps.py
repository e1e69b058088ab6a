"""The Keras trainer internals that a bound model's steps rely on (the
package's `__init__` registers these patches and checks these touchpoints
with its own).

- Every batch a Keras loop feeds goes through the JAX backend's
  `distribute_data_input`, one array at a time, as the process-local array
  it was drawn as: the one place where a batch can be checked after it is
  drawn and before it reaches a step.
- A padded batch is counted by its real rows in the loss tracker Keras
  keeps (`Trainer._loss_tracker`), which weighs each batch by its rows.
"""

from __future__ import annotations

_DATA_LIB = "keras.src.backend.jax.distribution_lib"
_FEEDING = "while a bound model's method feeds batches"
_MODEL_LIFETIME = "for the life of the bound model"

# The fields of `compat.Patch` (name, holder, attribute, owner, lasts).
PATCH_FIELDS = (
    (
        "checked_batches",
        _DATA_LIB,
        "distribute_data_input",
        "keras_hub_autodist.training.drawn_batches",
        _FEEDING,
    ),
    (
        "padded_steps",
        None,
        "<train_step, test_step, compute_loss, compute_metrics, and the loss "
        "tracker's update_state>",
        "keras_hub_autodist.training.padded_steps",
        _MODEL_LIFETIME,
    ),
    (
        "kept_state_steps",
        None,
        "<train_function, test_function, predict_function>",
        "keras_hub_autodist.training.keeping",
        _MODEL_LIFETIME,
    ),
)

# `_loss_tracker` (models): checked on live objects by
# tests/test_padding_exact.py.
TOUCHPOINTS = ((_DATA_LIB, "distribute_data_input"),)


def loss_tracker(model):
    """The `Mean` metric in which Keras averages a compiled model's loss
    over batches, each batch weighed by its rows (`model._loss_tracker`);
    None before `compile`."""
    return getattr(model, "_loss_tracker", None)
