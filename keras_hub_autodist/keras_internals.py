"""The one place that reaches into Keras internals (`keras.src`).

Sharded loading needs a hook that Keras has no public API for: the HDF5
weight store that `load_weights` reads from, so that a weight can be read
slice by slice instead of whole. Everything else in the package uses public
Keras APIs only (the variable hooks go on `keras.Variable`).
"""

from __future__ import annotations

from keras.src.saving.saving_lib import H5IOStore
from keras.src.saving.saving_lib import safe_get_h5_dataset

__all__ = ["H5IOStore", "safe_get_h5_dataset"]
