"""Every private Keras and keras-hub touchpoint of the package, in one place.

Nothing else in `keras_hub_autodist` imports `keras.src` or `keras_hub.src`
or reads a private attribute of a Keras or keras-hub object: it goes through
a function or name here. `TOUCHPOINTS` lists them all, and
`tests/test_compat.py` checks each one against the installed Keras and
keras-hub, so an upgrade shows exactly what broke.

The needs that have no public API:

- keras-hub's preset loaders (`get_preset_loader`, `KerasPresetLoader`,
  `TransformersPresetLoader`) tell the backbone class and config of a preset
  before anything is built, exactly as `from_preset` will read them.
- Sharded loading reads from the HDF5 weight store that `load_weights` uses,
  and from keras-hub's safetensors loader, so that a weight can be read
  slice by slice instead of whole.
- The abstract build creates a backbone's variables inside a
  `keras.StatelessScope(initialize_variables=False)`; Keras then keeps them
  in a process-wide list of uninitialized variables, which a later stateless
  scope would initialize (allocating the whole model). They are taken off
  that list again.
"""

from __future__ import annotations

import contextlib
import importlib

# (module, attribute) pairs this module relies on; `check_touchpoints()`
# imports each against the installed versions.
TOUCHPOINTS = (
    ("keras.src.backend.common.global_state", "get_global_attribute"),
    ("keras.src.saving.saving_lib", "H5IOStore"),
    ("keras.src.saving.saving_lib", "safe_get_h5_dataset"),
    ("keras_hub.src.utils.preset_utils", "get_preset_loader"),
    ("keras_hub.src.utils.preset_utils", "KerasPresetLoader"),
    ("keras_hub.src.utils.transformers.preset_loader", "TransformersPresetLoader"),
    ("keras_hub.src.utils.transformers.safetensor_utils", "SafetensorLoader"),
    ("keras.src.trainers.trainer", "Trainer"),
)


def check_touchpoints() -> list[str]:
    """The touchpoints missing from the installed Keras and keras-hub.

    Returns:
        `"module.attribute: why"` for each one that can't be imported; empty
        when every touchpoint is there.

    Example:
    ```python
    assert check_touchpoints() == []
    ```
    """
    missing = []
    for module_name, attribute in TOUCHPOINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            missing.append(f"{module_name}.{attribute}: {error}")
            continue
        if not hasattr(module, attribute):
            missing.append(f"{module_name}.{attribute}: no such attribute")
    return missing


# --- Keras -------------------------------------------------------------------


def h5_io_store():
    """Keras' HDF5 weight store class (`saving_lib.H5IOStore`)."""
    from keras.src.saving.saving_lib import H5IOStore

    return H5IOStore


def h5_dataset(store, key):
    """The HDF5 dataset `key` of a Keras weight store's current group."""
    from keras.src.saving.saving_lib import safe_get_h5_dataset

    return safe_get_h5_dataset(store._h5_entry_group, key)


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
    from keras.src.backend.common import global_state

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


# --- keras-hub -----------------------------------------------------------------


def preset_loader(preset: str):
    """keras-hub's loader for `preset` (`preset_utils.get_preset_loader`)."""
    from keras_hub.src.utils import preset_utils

    return preset_utils.get_preset_loader(preset)


def keras_preset_loader(label: str, config: dict):
    """keras-hub's loader of a Keras preset whose `config.json` is `config`."""
    from keras_hub.src.utils import preset_utils

    return preset_utils.KerasPresetLoader(label, config)


def transformers_preset_loader(label: str, config: dict):
    """keras-hub's loader of a Hugging Face checkpoint whose `config.json` is
    `config` (raises `ValueError` for a `model_type` it can't convert)."""
    from keras_hub.src.utils.transformers import preset_loader as loaders

    return loaders.TransformersPresetLoader(label, config)


def safetensor_utils_module():
    """keras-hub's module that opens Hugging Face weight files.

    Its `SafetensorLoader` opens each `*.safetensors` file with
    `safetensors.safe_open`, looked up on the module's `safetensors`
    attribute at each call; sharded loading swaps that attribute for the
    duration of a load (`loading.py`).
    """
    from keras_hub.src.utils.transformers import safetensor_utils

    return safetensor_utils


# --- sharded loading: Keras variables and weight stores ------------------------

# The method Keras calls to give a new variable its initial value; sharded
# loading replaces it on `keras.Variable` for the duration of a load.
VARIABLE_INITIALIZE_METHOD = "_initialize_with_initializer"


def variable_layout(variable):
    """The layout (`TensorLayout` or JAX sharding) Keras gave `variable`
    under a distribution, or `None` (`variable._layout`)."""
    return getattr(variable, "_layout", None)


def initialize_variable_layout(variable) -> None:
    """Let Keras compute `variable`'s layout from the current distribution
    without giving it a value (`variable._initialize_layout()`)."""
    variable._initialize_layout()


def variable_dtype(variable):
    """The dtype `variable` stores, before autocasting (`variable._dtype`)."""
    return variable._dtype


def variable_declared_shape(variable) -> tuple:
    """The shape `variable` was created with, readable before it has a value
    (`variable._shape`)."""
    return variable._shape


def variable_array(variable):
    """The array that holds `variable`'s value (`variable._value`)."""
    return variable._value


def set_variable_array(variable, array) -> None:
    """Make `array` (laid out as the variable's layout, or `None`) the value
    of `variable` without Keras' `assign` (`variable._value = array`)."""
    variable._value = array


def h5_store_archive(store):
    """The zip archive a Keras weight store reads from (`.keras` files), or
    `None` for a plain `.weights.h5` file (`store.archive`)."""
    return getattr(store, "archive", None)


# --- compiled memory check ----------------------------------------------------


def set_variable_layout(variable, layout) -> None:
    """Give a deferred (valueless) variable the layout Keras would give it
    on creation (`variable._layout`), so that the optimizer slots built from
    it (`add_variable_from_reference`) take the same layout, as they do for
    a real model."""
    variable._layout = layout


def symbolic_build(model, data_batch) -> None:
    """Build a compiled model's metrics, loss and optimizer state for a batch
    of `data_batch`'s shapes (`Trainer._symbolic_build`), as `fit` and
    `train_on_batch` do before their first step."""
    from keras.src.trainers.trainer import Trainer

    Trainer._symbolic_build(model, data_batch=data_batch)
