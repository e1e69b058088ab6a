"""The process's global random state, kept as it was around this package's
own work.

Building a Keras model draws from Python's `random`: each `SeedGenerator`
and random initializer made without a seed takes one from it
(`keras.random`'s default seed). `keras.random` functions given no seed draw
from Keras' global `SeedGenerator`. This package builds models the user did
not ask for (the abstract build that plans a config, the abstract model of
a compiled step); their draws would move the user's streams, so that the
model `from_preset` loads next, or any the user builds, would get other
seeds than without the package, and other ones on a cold cache (which
builds) than on a warm one (which reads). `global_random_kept` puts
Python's, NumPy's and Keras' global random state back as they were around
such work.

Keras' global generator is read where Keras keeps it (`keras.src`'s global
state), and only where Keras is imported already: keeping it never imports
Keras (nor NumPy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from collections.abc import Iterator
from typing import Any

_SEED_GENERATOR_MODULE = "keras.src.random.seed_generator"
# (module, attribute) pairs this module relies on (`compat.TOUCHPOINTS`).
TOUCHPOINTS = (
    (_SEED_GENERATOR_MODULE, "GLOBAL_SEED_GENERATOR"),
    ("keras.src.backend.common.global_state", "get_global_attribute"),
    ("keras.src.backend.common.global_state", "set_global_attribute"),
)
_NOT_IMPORTED = object()


@dataclasses.dataclass(frozen=True)
class GlobalRandomState:
    """Python's, NumPy's and Keras' global random state at one moment.

    Attributes:
        python: `random.getstate()`.
        numpy: `numpy.random.get_state()`, or None where NumPy was not
            imported.
        keras_generator: Keras' global `SeedGenerator`, None where none was
            made yet, or a marker where Keras was not imported.
        keras_seed: that generator's state as a host array, or None.
    """

    python: Any
    numpy: Any
    keras_generator: Any
    keras_seed: Any

    @classmethod
    def now(cls) -> GlobalRandomState:
        numpy = sys.modules.get("numpy")
        generator = _keras_generator()
        seed = None
        if generator is not None and generator is not _NOT_IMPORTED:
            seed = numpy.array(generator.state.value)
        return cls(
            random.getstate(),
            numpy.random.get_state() if numpy is not None else None,
            generator,
            seed,
        )

    def restore(self) -> None:
        """Put every global random state back as it was."""
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None:
            numpy.random.set_state(self.numpy)
        if _keras_generator() is _NOT_IMPORTED:
            return
        generator = self.keras_generator
        if generator is _NOT_IMPORTED:  # any made since Keras' import is new
            generator = None
        if _keras_generator() is not generator:
            _set_keras_generator(generator)
        if generator is not None:
            value = generator.state.value
            if not numpy.array_equal(numpy.asarray(value), self.keras_seed):
                generator.state.assign(self.keras_seed.astype(value.dtype))


def _keras_generator():
    """Keras' global `SeedGenerator` (None where none was made yet), or
    `_NOT_IMPORTED` where Keras' random module is not imported."""
    if _SEED_GENERATOR_MODULE not in sys.modules:
        return _NOT_IMPORTED
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


def _set_keras_generator(generator) -> None:
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, generator)


@contextlib.contextmanager
def global_random_kept() -> Iterator[None]:
    """Run the body, then put Python's, NumPy's and Keras' global random
    state back as they were before it (by an exception too). Works as a
    decorator too.

    Example:
    ```python
    with global_random_kept():
        backbone = backbone_cls.from_config(config)  # draws seeds
    random.getstate()  # as before the build
    ```
    """
    saved = GlobalRandomState.now()
    try:
        yield
    finally:
        saved.restore()
