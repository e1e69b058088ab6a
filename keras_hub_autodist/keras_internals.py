"""The one place that reaches into Keras internals (`keras.src`).

Two needs have no public Keras API:

- Sharded loading reads from the HDF5 weight store that `load_weights` uses,
  so that a weight can be read slice by slice instead of whole.
- The abstract build (`abstract.py`) creates a backbone's variables inside a
  `keras.StatelessScope(initialize_variables=False)`; Keras then keeps them
  in a process-wide list of uninitialized variables, which a later stateless
  scope would initialize (allocating the whole model). They are taken off
  that list again.

Everything else in the package uses public Keras APIs only (the variable
hooks go on `keras.Variable`).
"""

from __future__ import annotations

import contextlib

from keras.src.backend.common import global_state
from keras.src.saving.saving_lib import H5IOStore
from keras.src.saving.saving_lib import safe_get_h5_dataset

__all__ = ["H5IOStore", "deferred_variables", "safe_get_h5_dataset"]


@contextlib.contextmanager
def deferred_variables():
    """A scope where new variables get a shape but no value, and are then
    forgotten by Keras (never initialized later by another scope).

    Example:
    ```python
    with deferred_variables():
        backbone = keras_hub.models.GemmaBackbone(**config)
    ```
    """
    import keras

    pending = global_state.get_global_attribute(
        "uninitialized_variables", [], set_to_default=True
    )
    before = len(pending)
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        current = global_state.get_global_attribute("uninitialized_variables")
        if current is pending:
            del pending[before:]
