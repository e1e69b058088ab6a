"""One warning where labels outside the vocabulary reach a bound causal
LM's sparse cross-entropy.

Keras' sparse cross-entropy one-hot encodes each label: a label outside the
vocabulary, negative or too large (Hugging Face's -100, its mark for a token
to ignore), becomes a row of zeros. Such a token adds 0 to the loss and 0 to
its gradient, but still counts as a token in the mean the default reduction
takes, so the loss is lower than the mean over the real tokens: not what
"ignore" means to Hugging Face's loss. keras-hub computes the same, and a
bound model keeps Keras' meaning (its chunked loss too); it says so once
per model (`OutOfVocabularyLabelWarning`), with how to leave those tokens
out, where the data holds such a label with a weight other than 0.

The check reads only labels handed over as host NumPy arrays (`fit`,
`evaluate`, `train_on_batch`, `test_on_batch`, and `fit`'s
`validation_data`): one vectorized pass on the host before Keras places
them, never a read back from the devices, which would wait on each step.
The batches of a dataset or generator are not checked: Keras places them
one array at a time without saying which one holds the labels.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_hub_autodist.errors import OutOfVocabularyLabelWarning
from keras_hub_autodist.errors import warn

# method -> positions of (y, sample_weight) among its positional arguments.
_LABELED = {
    "fit": (1, 10),
    "evaluate": (1, 4),
    "train_on_batch": (1, 2),
    "test_on_batch": (1, 2),
}
# On a model: whether the warning was said.
_SAID_ATTR = "__keras_hub_autodist_label_range_said__"


def warn_labels_outside_vocabulary(model, method: str, args, kwargs) -> None:
    """Say once per model (`OutOfVocabularyLabelWarning`) that host labels
    passed to `method` lie outside the vocabulary where a sparse
    cross-entropy reads them; nothing otherwise.

    Args:
        model: a bound task.
        method: the bound method called (`"fit"`, `"train_on_batch"`...).
        args: its positional arguments.
        kwargs: its keyword arguments.
    """
    if method not in _LABELED or vars(model).get(_SAID_ATTR):
        return
    loss = getattr(model, "loss", None)
    vocabulary = _vocabulary_size(model)
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return
    if vocabulary is None:
        return
    label_index, weight_index = _LABELED[method]
    feeds = [
        (
            _argument(args, kwargs, label_index, "y"),
            _argument(args, kwargs, weight_index, "sample_weight"),
        )
    ]
    validation = kwargs.get("validation_data") if method == "fit" else None
    if isinstance(validation, (tuple, list)) and len(validation) in (2, 3):
        feeds.append((validation[1], validation[2] if len(validation) == 3 else None))
    for labels, weights in feeds:
        found = outside_vocabulary(labels, weights, vocabulary, loss.ignore_class)
        if found:
            count, example = found
            object.__setattr__(model, _SAID_ATTR, True)
            warn(
                _message(model, method, count, example, vocabulary),
                OutOfVocabularyLabelWarning,
            )
            return


def outside_vocabulary(labels, weights, vocabulary: int, ignored=None):
    """`(count, example)` of the host `labels` outside `[0, vocabulary)`
    that a sparse cross-entropy counts (a weight other than 0, and not its
    `ignored` class), read as Keras' loss reads them (through float32 to
    an integer, toward zero); None where there is none, or where `labels`
    (or `weights`) are not host NumPy arrays.

    Example:
    >>> outside_vocabulary(np.array([[1, -100, 3]]), None, 10)
    (1, -100)
    """
    if not isinstance(labels, np.ndarray) or labels.dtype.kind not in "iuf":
        return None
    read = np.trunc(labels.astype(np.float32))
    outside = (read < 0) | (read >= vocabulary)
    if ignored is not None:
        outside &= read != ignored
    if weights is not None:
        if not isinstance(weights, np.ndarray):
            return None
        outside &= _token_weights(weights, labels.shape) != 0
    count = int(np.count_nonzero(outside))
    if not count:
        return None
    return count, labels[outside].flat[0].item()


def _token_weights(weights: np.ndarray, shape) -> np.ndarray:
    """The sample weights brought to the labels' shape as Keras brings them
    (a trailing axis of 1 dropped, a weight per row spread over its
    tokens)."""
    while weights.ndim > len(shape) and weights.shape[-1] == 1:
        weights = weights[..., 0]
    if weights.ndim < len(shape):
        weights = weights.reshape(weights.shape + (1,) * (len(shape) - weights.ndim))
    return np.broadcast_to(weights, shape)


def _vocabulary_size(model) -> int | None:
    size = getattr(getattr(model, "backbone", None), "vocabulary_size", None)
    if isinstance(size, int):
        return size
    outputs = getattr(model, "outputs", None) or []
    last = outputs[0].shape[-1] if len(outputs) == 1 else None
    return last if isinstance(last, int) else None


def _argument(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _message(model, method, count, example, vocabulary) -> str:
    return (
        f"keras_hub_autodist: {count} labels passed to "
        f"{type(model).__name__}.{method}() lie outside the vocabulary "
        f"[0, {vocabulary}) (e.g. {example}; Hugging Face marks a token to "
        "ignore with -100). Keras' sparse cross-entropy, as keras-hub "
        "compiles it, gives such a token a loss of 0 but still counts it in "
        "the mean over tokens, so the loss is lower than the mean over the "
        "real tokens. To leave those tokens out, give them a sample weight "
        "of 0 (`sample_weight=(labels >= 0)`, as keras-hub's preprocessor "
        "weighs padding by its `padding_mask`), and compile the loss with "
        "`reduction='mean_with_sample_weight'` to average over the weighted "
        f"tokens only. Received: labels with {count} "
        f"values outside [0, {vocabulary}), e.g. {example}"
    )
