"""The Keras trainer internals that a bound model's steps rely on (the
package's `__init__` registers these patches and checks these touchpoints
with its own).

- Every batch a Keras loop feeds goes through the JAX backend's
  `distribute_data_input`, one array at a time, as the process-local array
  it was drawn as: the one place where a batch can be checked after it is
  drawn and before it reaches a step.
- A padded batch is counted by its real rows in the loss tracker Keras
  keeps (`Trainer._loss_tracker`), which weighs each batch by its rows.
- Keras' compiled metrics (`Trainer._compile_metrics`, a `CompileMetrics`)
  update the `metrics` of `compile` without any sample weight; on a padded
  batch those metrics are updated here with a weight of 1 on each real row
  and 0 on each padded one, which on an unpadded batch equals no weight.
- After each step Keras' JAX trainer puts the state the step returned back
  on the variables (`jax_state_sync`, from `Trainer._jax_state`), each with
  `assign`, which checks the value's sharding against the variable's layout
  (`distribute_tensor`) where a distribution laid it out: about 2 µs a
  variable, every step, which a model without a distribution never pays.
  `layout_checked_state_sync` assigns a value whose sharding is the very
  object that variable's layout was last checked against as it is.
"""

from __future__ import annotations

from collections.abc import Callable

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
        "values_kept_on_mesh",
        _DATA_LIB,
        "distribute_tensor",
        "keras_hub_autodist.training.placement",
        _FEEDING,
    ),
    (
        "padded_steps",
        None,
        "<train_step, test_step, compute_loss, compute_metrics, and the "
        "update_state of the loss tracker and the compiled metrics>",
        "keras_hub_autodist.training.padded_steps",
        _MODEL_LIFETIME,
    ),
    (
        "chunked_loss_steps",
        None,
        "<call, compute_loss_and_updates, compute_loss, compute_metrics of a "
        "causal LM, and call of its compiled loss while a step is traced>",
        "keras_hub_autodist.loss.chunked_steps",
        _MODEL_LIFETIME,
    ),
    (
        "layout_checked_state_sync",
        None,
        "jax_state_sync",
        "keras_hub_autodist.training.binding",
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

# `_loss_tracker`, `_compile_metrics` (models) and `built`, `build`,
# `_flatten_y`, `_flat_metrics`, `_flat_weighted_metrics` (`CompileMetrics`):
# checked on live objects by tests/test_padding_exact.py.
TOUCHPOINTS = (
    (_DATA_LIB, "distribute_data_input"),
    (_DATA_LIB, "distribute_tensor"),
    ("keras.src.backend.common.stateless_scope", "in_stateless_scope"),
    ("keras.src.backend.jax.trainer", "JAXTrainer"),
    ("keras.src.models.functional", "Functional.call"),
    ("keras.src.trainers.trainer", "Trainer._compute_loss"),
)


def trunk_and_head(task):
    """`(trunk, head)`: a Functional task cut where its backbone's output
    enters the rest of its graph, as two Keras models sharing the task's
    layers (`trunk(inputs)` is the backbone's output, `head(trunk(inputs))`
    the task's); None for a task that isn't one graph through its backbone
    to one output (read off the backbone's call nodes, `_inbound_nodes`)."""
    import keras

    backbone = getattr(task, "backbone", None)
    outputs = getattr(task, "outputs", None)
    if backbone is None or not outputs or len(outputs) != 1:
        return None
    for node in getattr(backbone, "_inbound_nodes", []):
        if len(node.outputs) != 1:
            continue
        try:
            head = keras.Model(node.outputs[0], outputs[0])
            trunk = keras.Model(task.inputs, node.outputs[0])
        except ValueError:  # a call of the backbone outside the task's graph
            continue
        return trunk, head
    return None


# The methods Keras' JAX trainer runs a training or test step through:
# `train_step` and `test_step` call `compute_loss_and_updates`, which calls
# `stateless_compute_loss`, `_compute_loss` and `compute_loss`; then
# `compute_metrics`.
STEP_METHODS = (
    "train_step",
    "test_step",
    "compute_loss_and_updates",
    "stateless_compute_loss",
    "_compute_loss",
    "compute_loss",
    "compute_metrics",
)


def overridden_step_methods(task) -> list[str]:
    """The methods of a Keras training step (`STEP_METHODS`) that `task`'s
    class defines in place of Keras' own, and `call` where the class
    replaces the Functional graph's; [] for a Functional model that runs
    Keras' own step."""
    import keras
    from keras.src.models.functional import Functional

    cls = type(task)
    names = [
        name
        for name in STEP_METHODS
        if getattr(cls, name, None) is not getattr(keras.Model, name, None)
    ]
    if getattr(cls, "call", None) is not Functional.call:
        names.append("call")
    return names


def loss_function(loss) -> tuple:
    """`(function, keyword arguments)` a Keras `LossFunctionWrapper` (e.g.
    `SparseCategoricalCrossentropy`) computes each value with (`fn`,
    `_fn_kwargs`)."""
    return getattr(loss, "fn", None), dict(getattr(loss, "_fn_kwargs", None) or {})


def metric_function(metric) -> tuple:
    """`(function, keyword arguments)` a Keras `MeanMetricWrapper` (e.g.
    `SparseCategoricalAccuracy`) computes each value with (`_fn`,
    `_fn_kwargs`)."""
    return getattr(metric, "_fn", None), dict(getattr(metric, "_fn_kwargs", None) or {})


def compiled_metric_objects(model) -> list:
    """The `metrics` and `weighted_metrics` given to `compile`, flattened
    (`CompileMetrics._user_metrics`, `_user_weighted_metrics`); [] where
    neither was given."""
    import keras

    compiled = compiled_metrics(model)
    if compiled is None:
        return []
    given = [compiled._user_metrics, compiled._user_weighted_metrics]
    return [m for m in keras.tree.flatten(given) if m is not None]


def loss_tracker(model):
    """The `Mean` metric in which Keras averages a compiled model's loss
    over batches, each batch weighed by its rows (`model._loss_tracker`);
    None before `compile`."""
    return getattr(model, "_loss_tracker", None)


def compiled_metrics(model):
    """The `CompileMetrics` in which Keras keeps a compiled model's `metrics`
    and `weighted_metrics` (`model._compile_metrics`); None before `compile`
    or when it was given neither."""
    return getattr(model, "_compile_metrics", None)


def update_metrics_by_rows(compiled, y_true, y_pred, sample_weight, row_weights):
    """`CompileMetrics.update_state`, except that the unweighted metrics
    weigh each row by `row_weights` (1 for a real row, 0 for a padded one)
    where Keras gives them no weight; the weighted metrics get
    `sample_weight` as Keras gives it to them."""
    if not compiled.built:
        compiled.build(y_true, y_pred)
    flat_true = compiled._flatten_y(y_true)
    flat_pred = compiled._flatten_y(y_pred)
    for metric, y_t, y_p in zip(compiled._flat_metrics, flat_true, flat_pred):
        if metric:
            metric.update_state(y_t, y_p, sample_weight=row_weights)
    if sample_weight is not None:
        weights = compiled._flatten_y(sample_weight)
        # One sample weight for several outputs applies to each, as in Keras.
        if len(weights) < len(flat_true):
            weights = [weights[0]] * len(flat_true)
    else:
        weights = [None] * len(flat_true)
    for metric, y_t, y_p, weight in zip(
        compiled._flat_weighted_metrics, flat_true, flat_pred, weights
    ):
        if metric:
            metric.update_state(y_t, y_p, weight)


# The state groups of `Trainer._jax_state`, each with the variables it
# holds the values of, in order.
_STATE_GROUPS = (
    ("trainable_variables", lambda model: model.trainable_variables),
    ("non_trainable_variables", lambda model: model.non_trainable_variables),
    ("optimizer_variables", lambda model: model.optimizer.variables),
    ("metrics_variables", lambda model: model.metrics_variables),
)
# On a variable: the sharding its layout was last found to hold.
_CHECKED_SHARDING = "_keras_hub_autodist_checked_sharding"


def layout_checked_state_sync(model) -> Callable[[], None]:
    """`model.jax_state_sync`, with the layout check of each value skipped
    where its sharding is the object that variable's layout was last
    checked against (each step's compiled program returns its outputs with
    the same sharding objects); every other value goes through `assign`."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    original = model.jax_state_sync

    def sync():
        state = getattr(model, "_jax_state", None)
        if not state or model._jax_state_synced or in_stateless_scope():
            return original()
        for group, variables_of in _STATE_GROUPS:
            values = state.get(group)
            if values:
                for variable, value in zip(variables_of(model), values):
                    _assign_checked(variable, value)
        model._jax_state_synced = True

    return sync


def _assign_checked(variable, value) -> None:
    sharding = getattr(value, "sharding", None)
    held = variable._value
    if (
        sharding is not None
        and sharding is getattr(variable, _CHECKED_SHARDING, None)
        and held is not None
        and value.shape == held.shape
        and value.dtype == held.dtype
    ):
        variable._value = value
        return
    variable.assign(value)
    if sharding is not None and variable._value is value:
        object.__setattr__(variable, _CHECKED_SHARDING, sharding)
