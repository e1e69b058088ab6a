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
import threading

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
    # Instance attributes `_layout`, `_value` (variables) and
    # `_initial_epoch` (models): tests/test_checkpointing.py checks them on
    # live objects.
    ("keras.src.backend.common.variables", "Variable"),
    ("keras.src.trainers.trainer", "Trainer"),
    ("keras.src.callbacks.orbax_checkpoint", "OrbaxCheckpoint._save_checkpoint"),
    ("keras.src.backend.common.global_state", "set_global_attribute"),
    ("keras.src.random.seed_generator", "GLOBAL_SEED_GENERATOR"),
    # Saving from several processes: the HDF5 weight stores Keras' writers
    # create by these module-level names, swapped during a save.
    ("keras.src.saving.saving_lib", "ShardedH5IOStore"),
    ("keras.src.saving.saving_lib", "H5IOStore.make"),
    # ... and the optimizer's writer, which fetches each value itself.
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.save_own_variables"),
    # Checking a weights file against a model: the walk Keras' writers make.
    ("keras.src.saving.saving_lib", "_save_state"),
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
            found = importlib.import_module(module_name)
        except ImportError as error:
            missing.append(f"{module_name}.{attribute}: {error}")
            continue
        for name in attribute.split("."):  # "Class.method" too
            found = getattr(found, name, None)
        if found is None:
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
    """Give a Keras variable a lasting `TensorLayout` (`variable._layout`):
    Keras re-applies it at every `assign`, and optimizer slots built from a
    deferred variable (`add_variable_from_reference`) take it too."""
    variable._layout = layout


def symbolic_build(model, data_batch) -> None:
    """Build a compiled model's metrics, loss and optimizer state for a batch
    of `data_batch`'s shapes (`Trainer._symbolic_build`), as `fit` and
    `train_on_batch` do before their first step."""
    from keras.src.trainers.trainer import Trainer

    Trainer._symbolic_build(model, data_batch=data_batch)


# --- Checkpoints: variable layouts, restored training position ------------------


def variable_value_or_none(variable):
    """A Keras variable's stored value (`variable._value`), without autocast;
    None while a running JAX `fit` holds the state."""
    return getattr(variable, "_value", None)


def set_initial_epoch(model, epoch: int) -> None:
    """Make the model's running `fit` start at `epoch` (`model._initial_epoch`),
    as `keras.callbacks.BackupAndRestore` does from `on_train_begin`."""
    model._initial_epoch = epoch


# `keras.callbacks.OrbaxCheckpoint` keeps its batch counters in attributes
# set by its `__init__`: `_total_batches_seen` (the step number of the next
# save), `_last_batch_seen` and `_batches_seen_since_last_saving`.


def orbax_unsaved_batches(callback) -> int:
    """Batches an `OrbaxCheckpoint` trained on since its last save."""
    return callback._batches_seen_since_last_saving


def orbax_resume_counters(callback, batches_done: int) -> None:
    """Make an `OrbaxCheckpoint` number its next saves after `batches_done`
    batches, as if it had seen them (a resumed run)."""
    callback._total_batches_seen = batches_done
    callback._batches_seen_since_last_saving = 0


def orbax_skip_batch(callback, batch: int) -> None:
    """Let an `OrbaxCheckpoint` see batch `batch` of the epoch without
    counting it (a batch skipped on resume)."""
    callback._last_batch_seen = batch


def orbax_save_now(callback, logs=None) -> None:
    """Save an `OrbaxCheckpoint` now, numbered by the batches seen
    (`OrbaxCheckpoint._save_checkpoint`), unless it just saved."""
    if callback._batches_seen_since_last_saving:
        callback._save_checkpoint(step=callback._total_batches_seen, logs=logs)
        callback._batches_seen_since_last_saving = 0


# --- Resume: Keras' global random state -----------------------------------------

# Keras keeps the `SeedGenerator` that `keras.random` functions draw from when
# given no seed as a process-wide attribute, created on first use.


def global_seed_generator_or_none():
    """Keras' global `keras.random.SeedGenerator`, or None while nothing has
    drawn from it (reading it does not create one: creating one draws its
    seed from Python's `random`)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(generator) -> None:
    """Make `generator` Keras' global `keras.random.SeedGenerator`."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, generator)


# --- Saving from several processes: Keras' HDF5 weight stores ------------------

# The names under which `keras.src.saving.saving_lib` creates its weight
# stores (`save_weights_only`, `save_model`) and checks them (`_save_state`).
_WEIGHT_STORE_NAMES = ("H5IOStore", "ShardedH5IOStore")


def _converting_store(base, convert, opened):
    """A subclass of the weight store `base` that writes `convert(value)`."""

    class ConvertingStore(base):
        def __init__(self, *args, **kwargs):
            opened(lambda: base.__init__(self, *args, **kwargs))

        def __setitem__(self, key, value):
            base.__setitem__(self, key, convert(value))

    ConvertingStore.__name__ = ConvertingStore.__qualname__ = base.__name__
    return ConvertingStore


def _discarding_store(base, convert, opened):
    """A stand-in for the weight store `base` that opens no file: it passes
    every value to `convert` and keeps nothing."""

    class DiscardingStore(base):
        def __init__(self, path_or_io, *args, mode="r", **kwargs):
            self.path_or_io = path_or_io
            self.mode = mode
            self.archive = None
            self.io_file = None
            opened(lambda: None)

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            return self

        def __setitem__(self, key, value):
            convert(value)

        def close(self):
            pass

    DiscardingStore.__name__ = DiscardingStore.__qualname__ = base.__name__
    return DiscardingStore


@contextlib.contextmanager
def weight_stores_writing(convert, opened, write: bool = True):
    """A scope where Keras' HDF5 weight writers pass each value through
    `convert` (Keras' `H5IOStore` and `ShardedH5IOStore`, as `save_weights`,
    `save` and keras-hub's `save_to_preset` create them).

    With `write=True`, each store writes `convert(value)` (a NumPy array, or
    the value for Keras to convert as usual). With `write=False`, each store
    opens no file and writes nothing: it calls `convert(value)` for every
    value Keras would write, in the same order, and drops the result.
    `opened(open_file)` is called when a store is created, with a function
    that opens its file.

    Keras' optimizers fetch each of their values to NumPy before handing it
    to the store (`BaseOptimizer.save_own_variables`), which fails for an
    array spanning other processes: within the scope they hand the store the
    variable itself, as layers do.

    The stores and the optimizer's method are swapped in Keras' modules for
    the duration of the scope, so the scope covers every thread of the
    process.

    Example:
    ```python
    with weight_stores_writing(np.asarray, lambda open_file: open_file()):
        model.save_weights("model.weights.h5")
    ```
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.saving import saving_lib

    originals = {name: getattr(saving_lib, name) for name in _WEIGHT_STORE_NAMES}
    optimizer_saver = BaseOptimizer.__dict__["save_own_variables"]
    make = _converting_store if write else _discarding_store
    try:
        for name, base in originals.items():
            setattr(saving_lib, name, make(base, convert, opened))
        BaseOptimizer.save_own_variables = _save_optimizer_variables
        yield
    finally:
        BaseOptimizer.save_own_variables = optimizer_saver
        for name, base in originals.items():
            setattr(saving_lib, name, base)


def _save_optimizer_variables(optimizer, store):
    """`BaseOptimizer.save_own_variables`, handing the store each variable
    instead of its NumPy value."""
    for index, variable in enumerate(optimizer.variables):
        store[str(index)] = variable


# --- Weights files: what Keras writes, and a fingerprint written with it ------

# Keras' weights files (`.weights.h5`, the `model.weights.h5` of a `.keras`)
# hold each saveable's variables in a group `<path>/vars`, one dataset per
# variable, named by its index; `BaseOptimizer.save_own_variables` writes
# `optimizer/vars/<i>` for its i-th variable.
OPTIMIZER_H5_GROUP = "optimizer/vars"
# Held while Keras' weight stores are swapped (`h5_dataset_written_with`).
_SAVE_HOOK_LOCK = threading.RLock()


def weights_file_datasets(model) -> dict[str, object]:
    """The datasets Keras' `save_weights` writes for `model`, but the
    optimizer's (`OPTIMIZER_H5_GROUP`): HDF5 path -> the variable (or, for a
    layer that merges LoRA kernels into its kernel, the array) it holds.

    Found by Keras' own walk (`saving_lib._save_state`) into a store that
    keeps what it is handed and writes nothing.

    Example:
    ```python
    shapes = {key: v.shape for key, v in weights_file_datasets(model).items()}
    ```
    """
    from keras.src.saving import saving_lib

    def recording_store(base):
        class RecordingStore(base):
            def __init__(self):
                self.mode = "w"
                self.archive = None
                self.io_file = None
                self.entries = {}
                self._group = "vars"

            def __bool__(self):
                return True

            def make(self, path, metadata=None):
                self._group = f"{path}/vars" if path else "vars"
                return self

            def __setitem__(self, key, value):
                self.entries[f"{self._group}/{key}"] = value

            def close(self):
                pass

        return RecordingStore()

    optimizer = getattr(model, "optimizer", None)
    skipped = {id(optimizer)} if optimizer is not None else set()
    # `_save_state` checks the store's class against `saving_lib`'s, which a
    # save in another thread may be swapping.
    with _SAVE_HOOK_LOCK:
        store = recording_store(saving_lib.H5IOStore)
        saving_lib._save_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            visited_saveables=skipped,
        )
    return store.entries


@contextlib.contextmanager
def h5_dataset_written_with(name: str, text: str):
    """A scope in which the HDF5 weights file that Keras' `save_weights` or
    `save` opens for writing on this thread gets a root dataset `name`
    holding `text`, written with the file (a `.weights.h5`, the first shard
    of a `.weights.json`, the `model.weights.h5` inside a `.keras`).

    Keras' loaders read only the groups they know, so they ignore it. The
    stores are swapped in `saving_lib` for the duration of the scope, under a
    lock (scopes in several threads run one after the other); stores opened
    by other threads meanwhile are left as they are.

    Example:
    ```python
    with h5_dataset_written_with("notes", "{}"):
        model.save_weights("model.weights.h5")
    ```
    """
    from keras.src.saving import saving_lib

    owner = threading.get_ident()

    def marking(base):
        class MarkingStore(base):
            def __init__(self, *args, **kwargs):
                base.__init__(self, *args, **kwargs)
                h5_file = getattr(self, "h5_file", None)
                if (
                    getattr(self, "mode", None) == "w"
                    and h5_file is not None
                    and threading.get_ident() == owner
                    and name not in h5_file
                ):
                    h5_file.create_dataset(name, data=text)

        MarkingStore.__name__ = MarkingStore.__qualname__ = base.__name__
        return MarkingStore

    with _SAVE_HOOK_LOCK:
        originals = {n: getattr(saving_lib, n) for n in _WEIGHT_STORE_NAMES}
        try:
            for store_name, base in originals.items():
                setattr(saving_lib, store_name, marking(base))
            yield
        finally:
            for store_name, base in originals.items():
                setattr(saving_lib, store_name, base)
