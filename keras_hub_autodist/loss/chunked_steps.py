"""A bound causal LM's steps with the loss taken a chunk of tokens at a time.

keras-hub's causal LMs compile `SparseCategoricalCrossentropy(from_logits=
True)` with `SparseCategoricalAccuracy` as their weighted metric, and
Keras' step makes the whole `[batch, sequence, vocabulary]` logits, reads
them in float32 for the loss, and keeps them for the metrics. Here a bound
task's `train_step` and `test_step` (through `compute_loss_and_updates`,
which both call) run its graph up to the backbone's output, and the head
(the output projection, with any soft cap) runs inside the loss one chunk
of tokens at a time (`chunked_cross_entropy`). What comes out is what
Keras computes from whole logits:

- the loss: each token's cross-entropy goes through the compiled loss
  object itself (its `call` answers the per-token values while the step is
  traced), so sample weights, the reduction, loss weights, the losses
  layers add and the padded-batch correction (`padded_steps`) are Keras'
  and this package's own;
- the metric: each token's "argmax is the label" goes to the compiled
  `SparseCategoricalAccuracy` as two columns whose argmax is 1 exactly
  where it matched, against labels of 1, so its weighting is Keras' too.

Where `chunks.chunk_count` cuts them: a device's whole logits over 4 GiB,
or a head small enough to read again per chunk; elsewhere the step is
Keras' own, to the byte. The chunks' gradient is taken with their loss
(`chunked_cross_entropy`), so the head runs as often as in Keras' step.
`predict`, `generate` and any call outside a step keep whole logits. A
compiled loss other than keras-hub's cross-entropy exactly, metrics other
than its accuracy, or a step other than Keras' own (`compiled_defaults`)
keep the whole-logits step, with one `WholeLogitsWarning` that says why.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math

import jax.numpy as jnp
import keras
import numpy as np

from keras_hub_autodist import compat
from keras_hub_autodist.compat import steps as compat_steps
from keras_hub_autodist.errors import WholeLogitsWarning
from keras_hub_autodist.errors import warn
from keras_hub_autodist.loss.chunked_cross_entropy import chunked_cross_entropy
from keras_hub_autodist.loss.chunks import chunk_count
from keras_hub_autodist.loss.compiled_defaults import note_replaced_step_methods
from keras_hub_autodist.loss.compiled_defaults import why_not_default_loss
from keras_hub_autodist.loss.compiled_defaults import why_not_default_metric
from keras_hub_autodist.loss.compiled_defaults import why_not_keras_step

# What a chunked step's `y_pred` holds for the metrics: `{MATCHES_KEY:
# [batch, sequence] 1.0 where the argmax was the label}`.
MATCHES_KEY = "keras_hub_autodist_token_matches"
# A dict while a step's loss is traced chunked: the loss leaves the matches
# in it for the metrics.
_TRACING = contextvars.ContextVar("keras_hub_autodist_chunked_step", default=None)
_CHUNKED_ATTR = "__keras_hub_autodist_chunked__"
# Reasons already said, per model.
_SAID = "__keras_hub_autodist_whole_logits_said__"


def install_chunked_loss(task, plan=None) -> bool:
    """Make `task`'s steps take the loss a chunk of tokens at a time;
    False (nothing changed) for a model whose graph isn't a backbone
    followed by a head that maps each token's state to its logits.

    Args:
        task: a keras-hub `CausalLM` (any Functional task of one output).
        plan: its `LayoutPlan`, whose mesh says what one device holds of
            the batch, the sequence and the vocabulary; `None`: all.
    """
    if getattr(task, _CHUNKED_ATTR, False) or not hasattr(task, "backbone"):
        return False
    split = compat_steps.trunk_and_head(task)
    if split is None:
        return False
    trunk, head = split
    width = head.inputs[0].shape[-1]
    shapes = [
        head.compute_output_spec(keras.KerasTensor((2, tokens, width))).shape
        for tokens in (3, 5)
    ]
    if [s[:2] for s in shapes] != [(2, 3), (2, 5)] or len(shapes[0]) != 3:
        return False  # the head mixes or drops tokens (e.g. PaliGemma's)
    note_replaced_step_methods(task)  # before the patches below replace them
    shares = _DeviceShares.of(plan)
    count = functools.partial(_chunks, head, shapes[0][-1], shares)
    patches = {
        "call": lambda method: _call(method, trunk),
        "compute_loss_and_updates": lambda method: _loss_and_updates(
            method, task, count
        ),
        "compute_loss": lambda method: _loss(method, task, head),
        "compute_metrics": _metrics,
    }
    for attribute, wrap in patches.items():
        method = getattr(task, attribute)
        wrapped = functools.wraps(method)(wrap(method))
        compat.patch_instance("chunked_loss_steps", task, attribute, wrapped)
    object.__setattr__(task, _CHUNKED_ATTR, True)
    return True


def why_whole_logits(task, y) -> str | None:
    """Why `task`'s step needs whole logits for labels `y`; None where it
    can take them a chunk at a time (`compiled_defaults`: keras-hub's
    default loss and accuracy, in Keras' own step)."""
    why = why_not_keras_step(task) or why_not_default_loss(getattr(task, "loss", None))
    if why is not None:
        return why
    for metric in compat_steps.compiled_metric_objects(task):
        why = why_not_default_metric(metric)
        if why is not None:
            return why
    if not _token_labels(y):
        return "its labels are not one [batch, sequence] array"
    return None


def _token_labels(y) -> bool:
    """Whether `y` is one `[batch, sequence]` array of labels."""
    return not keras.tree.is_nested(y) and len(getattr(y, "shape", ())) == 2


def _say_once(task, why: str) -> None:
    said = vars(task).setdefault(_SAID, set())
    if why not in said:
        said.add(why)
        warn(
            f"keras_hub_autodist: {type(task).__name__}'s step computes its loss "
            f"over the whole vocabulary's logits, because {why}. Compile with "
            "keras-hub's default loss and weighted metrics to take them a chunk "
            "of tokens at a time.",
            WholeLogitsWarning,
        )


def _argument(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs.get(name)


def _call(call, trunk):
    """The task's `call`: the backbone's output while a chunked step is
    traced, its logits otherwise."""

    def chunked_call(inputs, training=None, mask=None, **kwargs):
        if _TRACING.get() is None:
            return call(inputs, training=training, mask=mask, **kwargs)
        return trunk(inputs, training=training)

    return chunked_call


@dataclasses.dataclass(frozen=True)
class _DeviceShares:
    """How many devices share a step's rows, each sequence, and the
    vocabulary of its logits (the batch, context and model axes)."""

    rows: int = 1
    sequence: int = 1
    vocabulary: int = 1

    @classmethod
    def of(cls, plan) -> _DeviceShares:
        if plan is None:
            return cls()
        axes = plan.mesh_axes
        return cls(
            axes.size(axes.batch_axis),
            axes.size(axes.context_axis),
            axes.size(axes.model_axis),
        )


def _chunks(head, vocabulary: int, shares: _DeviceShares, labels) -> int:
    """`chunk_count` for a step on `labels`, from one device's share."""
    batch, sequence = labels.shape
    split = shares.vocabulary if vocabulary % shares.vocabulary == 0 else 1

    def device_bytes(weights):
        total = sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in weights)
        return total // split

    return chunk_count(
        -(-batch // shares.rows),
        sequence,
        vocabulary // split,
        shares.sequence,
        device_bytes(head.weights),
        device_bytes(head.trainable_weights),
    )


def _loss_and_updates(compute_loss_and_updates, task, count):
    """`compute_loss_and_updates`: chunked where `count` cuts the logits
    and `why_whole_logits` finds no reason not to; its `y_pred` is then the
    per-token matches."""

    def chunked_loss_and_updates(*args, **kwargs):
        y = _argument(args, kwargs, 4, "y")
        why = why_whole_logits(task, y)
        chunks = count(y) if _token_labels(y) else 1
        if why is not None and chunks > 1:
            _say_once(task, why)  # only where the logits would have been cut
        if why is not None or chunks == 1:
            return compute_loss_and_updates(*args, **kwargs)  # Keras' own
        traced = {"chunks": chunks}
        token = _TRACING.set(traced)
        try:
            loss, (unscaled, _, non_trainable, metrics) = compute_loss_and_updates(
                *args, **kwargs
            )
        finally:
            _TRACING.reset(token)
        matches = {MATCHES_KEY: traced["matches"]}
        return loss, (unscaled, matches, non_trainable, metrics)

    return chunked_loss_and_updates


def _per_token_values(y_true, y_pred):
    """A compiled loss' `call` while a chunked step is traced: `y_pred`
    already holds each token's loss."""
    del y_true
    return y_pred


def _loss(compute_loss, task, head):
    """`compute_loss`: while a chunked step is traced, `y_pred` is the
    backbone's output; the head runs on it a chunk at a time and the
    per-token losses go through the compiled loss."""

    def chunked_loss(x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        traced = _TRACING.get()
        if traced is None:
            return compute_loss(x, y, y_pred, sample_weight, **kwargs)
        training = kwargs.get("training", False)
        frozen = [v.value for v in head.non_trainable_variables]

        def apply(trained, states):
            logits, _ = head.stateless_call(trained, frozen, states, training=training)
            return logits

        entropy, traced["matches"] = chunked_cross_entropy(
            apply,
            [v.value for v in head.trainable_variables],
            y_pred,
            y,
            _token_weights(sample_weight, y.shape),
            traced["chunks"],
        )
        with compat.instance_patched(
            "chunked_loss_steps", task.loss, "call", _per_token_values
        ):
            return compute_loss(x, y, entropy, sample_weight, **kwargs)

    return chunked_loss


def _token_weights(sample_weight, shape):
    """The weight Keras' loss reduction gives each token: the sample
    weight brought to `[batch, sequence]` as Keras brings it (a trailing
    axis of 1 dropped, a weight per row spread over its tokens), or 1."""
    if sample_weight is None:
        return jnp.ones(shape, jnp.float32)
    weights = jnp.asarray(sample_weight, jnp.float32)
    while weights.ndim > len(shape) and weights.shape[-1] == 1:
        weights = weights[..., 0]
    if weights.ndim < len(shape):
        weights = weights.reshape(weights.shape + (1,) * (len(shape) - weights.ndim))
    return jnp.broadcast_to(weights, shape)


def _metrics(compute_metrics):
    """`compute_metrics`: a chunked step's matches, as the compiled
    accuracy reads them (module docstring)."""

    def chunked_metrics(x, y, y_pred, sample_weight=None):
        if isinstance(y_pred, dict) and set(y_pred) == {MATCHES_KEY}:
            matches = y_pred[MATCHES_KEY]
            y_pred = jnp.stack([1.0 - matches, matches], axis=-1)
            y = jnp.ones_like(matches)
        return compute_metrics(x, y, y_pred, sample_weight)

    return chunked_metrics
