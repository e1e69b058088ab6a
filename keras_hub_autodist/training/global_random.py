"""Keras' global random state, saved beside a checkpoint and restored on resume.

`keras.random` functions called without a seed draw from one process-wide
`keras.random.SeedGenerator`. Under JAX a jitted train step can't use it
(Keras refuses unseeded random ops while tracing), and an eager train step
uses its state without advancing it. What draws from it are eager calls
outside the train step: a data pipeline's augmentation, a callback. So a
resumed run must start from its state at the checkpoint to see the same
numbers as a run that never stopped.

Keras' `OrbaxCheckpoint` saves the model's state tree as the checkpointable
`pytree`; the global state goes into a checkpointable of its own,
`keras_global_seed_generator` (`ResumableCheckpoint` adds it to each save),
so the `pytree` stays exactly Keras' format and Keras' own `load_weights`
reads the checkpoint as before. It holds the
generator's `state` (the `[seed, counter]` pair of Keras' `SeedGenerator`)
and `in_use` (0 when nothing had drawn from the generator yet; restoring then
leaves the generator alone). In several processes each process saves the
same structure, and the values of process 0 are the ones kept.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_hub_autodist.compat import state as compat_state

CHECKPOINTABLE = "keras_global_seed_generator"
_SEED_PAIR = 2  # Keras' seed state: [seed, counter]


def saved_form() -> dict:
    """Keras' global random state as the checkpointable to save.

    Example:
    >>> sorted(saved_form())
    ['in_use', 'state']
    """
    generator = compat_state.global_seed_generator_or_none()
    if generator is None:
        return {
            "state": np.zeros(_SEED_PAIR, np.uint32),
            "in_use": np.asarray(0, np.int32),
        }
    return {
        "state": np.asarray(generator.state.value),
        "in_use": np.asarray(1, np.int32),
    }


def restore(saved: dict) -> None:
    """Make Keras' global random state the one `saved_form()` returned.

    Nothing changes when the saved generator was not in use.

    Args:
        saved: the checkpointable `saved_form()` returned.

    Example:
    ```python
    restore(saved_form())  # the global stream continues where it was
    ```
    """
    if not int(np.asarray(saved["in_use"])):
        return
    generator = compat_state.global_seed_generator_or_none()
    if generator is None:
        # A given seed: creating the generator must not draw from Python's
        # `random` (the user's stream); the state is overwritten below.
        generator = keras.random.SeedGenerator(seed=0)
        compat_state.set_global_seed_generator(generator)
    state = np.asarray(saved["state"])
    generator.state.assign(state.astype(generator.state.dtype))
