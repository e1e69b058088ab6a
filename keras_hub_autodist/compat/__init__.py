"""Every private Keras and keras-hub touchpoint of the package: here
(loading, saving, building, patching), `steps` (the trainer's), `state` (a
layer's RNG state), `attention` (keras-hub's attention layers), `devices`
(keras-hub's device checks, answered for a compile target), `upstream`
(fixes of keras-hub bugs), `jax_start` (JAX's TPU backend start, quiet off
a TPU VM), `checkpoints` (a restored training position, Orbax's counters),
`random_state` (the global random state, kept around this package's own
builds), `traces` (a traced step's constants, where a leaked tracer
sits). Nothing else in `keras_hub_autodist` imports `keras.src` or
`keras_hub.src` or reads a private attribute of Keras', keras-hub's or
JAX's objects.
`tests/test_compat.py` checks each of `TOUCHPOINTS` against the installed
Keras and keras-hub, so an upgrade shows exactly what broke. Every
attribute of Keras or keras-hub that the package replaces is registered in
`PATCHES` (what, by whom, for how long, whether every thread sees it) and
set only by the functions at the end.

The needs that have no public API:

- keras-hub's preset loaders tell a preset's backbone class and config
  before anything is built, exactly as `from_preset` will read them.
- Sharded loading reads from `load_weights`' HDF5 store and keras-hub's
  safetensors loader, a weight slice by slice instead of whole.
- The abstract build takes the variables it makes off Keras' list of
  uninitialized ones, which a later stateless scope would initialize.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading

from keras_hub_autodist.compat import checkpoints as compat_checkpoints
from keras_hub_autodist.compat import devices as compat_devices
from keras_hub_autodist.compat import jax_start as compat_jax_start
from keras_hub_autodist.compat import random_state as compat_random_state
from keras_hub_autodist.compat import state as compat_state
from keras_hub_autodist.compat import steps as compat_steps
from keras_hub_autodist.compat import traces as compat_traces
from keras_hub_autodist.compat import upstream as compat_upstream
from keras_hub_autodist.compat.random_state import global_random_kept

# The checkpoints' touchpoints, by the names the package calls them.
variable_value_or_none = compat_checkpoints.variable_value_or_none
set_initial_epoch = compat_checkpoints.set_initial_epoch
orbax_unsaved_batches = compat_checkpoints.orbax_unsaved_batches
orbax_resume_counters = compat_checkpoints.orbax_resume_counters
orbax_skip_batch = compat_checkpoints.orbax_skip_batch
orbax_save_now = compat_checkpoints.orbax_save_now
# A traced step's leaked tracers (`traces`).
leaked_tracers = compat_traces.leaked_tracers

# keras-hub's names of its preset files (touchpoints: `preset_format_names`).
PRESET_FORMAT_NAMES = tuple(
    "CONFIG_FILE TOKENIZER_CONFIG_FILE AUDIO_CONVERTER_CONFIG_FILE "
    "IMAGE_CONVERTER_CONFIG_FILE VIDEO_CONVERTER_CONFIG_FILE TASK_CONFIG_FILE "
    "PREPROCESSOR_CONFIG_FILE METADATA_FILE MODEL_WEIGHTS_FILE TASK_WEIGHTS_FILE "
    "SHARDED_MODEL_WEIGHTS_CONFIG_FILE ASSET_DIR".split()
)
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
    # `_layout`, `_value` (variables), `_initial_epoch` (models): checked
    # on live objects by tests/test_checkpointing.py.
    ("keras.src.backend.common.variables", "Variable"),
    ("keras.src.trainers.trainer", "Trainer"),
    ("keras.src.callbacks.orbax_checkpoint", "OrbaxCheckpoint._save_checkpoint"),
    ("keras.src.backend.common.global_state", "set_global_attribute"),
    ("keras.src.random.seed_generator", "GLOBAL_SEED_GENERATOR"),
    # Saves from several processes swap the stores Keras' writers create.
    ("keras.src.saving.saving_lib", "ShardedH5IOStore"),
    ("keras.src.saving.saving_lib", "H5IOStore.make"),
    # ... and the optimizer's writer, which fetches each value itself.
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.save_own_variables"),
    *(("keras_hub.src.utils.preset_utils", name) for name in PRESET_FORMAT_NAMES),
    # Checking a weights file against a model: the walk Keras' writers make.
    ("keras.src.saving.saving_lib", "_save_state"),
    ("keras.src.layers.layer", "Layer._flatten_layers"),
    ("keras.src.backend.jax.nn", "_can_use_flash_attention"),
    *compat_state.TOUCHPOINTS,
    *compat_devices.TOUCHPOINTS,
    *compat_jax_start.TOUCHPOINTS,
    *compat_random_state.TOUCHPOINTS,
    *compat_upstream.TOUCHPOINTS,
    *compat_traces.TOUCHPOINTS,
) + compat_steps.TOUCHPOINTS


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
    for patch in PATCHES:
        if patch.process_wide:
            try:
                _resolve(patch.target)
            except (ImportError, AttributeError) as error:
                missing.append(f"{patch.target}: {error}")
    return missing


# --- Keras -------------------------------------------------------------------


def h5_io_store():
    """Keras' HDF5 weight store class (`saving_lib.H5IOStore`)."""
    from keras.src.saving.saving_lib import H5IOStore

    return H5IOStore


def save_state(model, make_store, skipped: set):
    """Walk `model`'s saveables as Keras' writers do
    (`saving_lib._save_state`), into `make_store(H5IOStore)`; return that
    store. `skipped`: the `id()`s of objects not to walk into.

    Keras checks the store against `saving_lib`'s store classes, which
    `patched` may be swapping in another thread: it is made and walked
    under the patch lock.
    """
    from keras.src.saving import saving_lib

    with _patch_lock:
        store = make_store(saving_lib.H5IOStore)
        saving_lib._save_state(
            model,
            weights_store=store,
            assets_store=None,
            inner_path="",
            visited_saveables=skipped,
        )
    return store


def h5_dataset(store, key):
    """The HDF5 dataset `key` of a Keras weight store's current group."""
    from keras.src.saving.saving_lib import safe_get_h5_dataset

    return safe_get_h5_dataset(store._h5_entry_group, key)


@contextlib.contextmanager
def deferred_variables():
    """A scope where new variables get a shape but no value, and are then
    forgotten by Keras (never initialized later by another scope). What is
    built there is this package's own, never the user's model: the seeds
    it draws are put back (`random_state.global_random_kept`), so that the
    user's streams move as without it.

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
        with (
            global_random_kept(),
            keras.StatelessScope(initialize_variables=False),
        ):
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


def preset_format_names() -> dict[str, str]:
    """keras-hub's names of the files of its preset format (the
    `preset_utils` constants in `PRESET_FORMAT_NAMES`): what its savers write
    and its loaders read. `preset_files.py` keeps a copy, for saves that run
    without keras-hub; tests/test_saving.py compares the two."""
    from keras_hub.src.utils import preset_utils

    return {name: getattr(preset_utils, name) for name in PRESET_FORMAT_NAMES}


def safetensor_utils_module():
    """keras-hub's module that opens Hugging Face weight files.

    Its `SafetensorLoader` opens each `*.safetensors` file with
    `safetensors.safe_open`, looked up on the module's `safetensors`
    attribute at each call; sharded loading swaps that attribute for the
    duration of a load (`loading/session.py`).
    """
    from keras_hub.src.utils.transformers import safetensor_utils

    return safetensor_utils


# --- sharded loading: Keras variables and weight stores ------------------------

# The method Keras calls to give a new variable its initial value; sharded
# loading replaces it on `keras.Variable` for the duration of a load.
VARIABLE_INITIALIZE_METHOD = "_initialize_with_initializer"


def sublayers(model) -> list:
    """Every layer nested in `model`, depth first."""
    return list(model._flatten_layers(include_self=False))


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


# --- Patches: every change this package makes to Keras and keras-hub ----------

WHILE_LOADING = "while a sharded load runs in some thread"
WHILE_SAVING = "while a multi-process save or a bound save_weights/save runs"
WHILE_ACTIVE = "from `activate()` (or the startup hook's guard) to `deactivate()`"
MODEL_LIFETIME = "for the life of the bound model"
WHILE_SKIPPING = "from a `ResumableCheckpoint` fit's start to its first trained batch"
WHILE_CONTEXT = "while a `ContextParallel` distribution's scope is entered"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One place where this package replaces Keras or keras-hub behaviour.

    A process-wide patch replaces an attribute of a class or module, which
    every thread sees: its replacement acts only for the thread (or context)
    that asked for it and defers to the original everywhere else. An
    instance patch replaces an attribute of one object.

    Args:
        name: the key the installers below take.
        holder: the dotted path of the class or module a process-wide patch
            changes; `None` for an instance patch.
        attribute: the attribute it replaces.
        owner: the module that supplies the replacement.
        lasts: how long it stays in place.
    """

    name: str
    holder: str | None
    attribute: str
    owner: str
    lasts: str

    @property
    def process_wide(self) -> bool:
        return self.holder is not None

    @property
    def target(self) -> str:
        return f"{self.holder or '<object>'}.{self.attribute}"


_SAVING_LIB = "keras.src.saving.saving_lib"
_H5_STORE = f"{_SAVING_LIB}.H5IOStore"
_SAFETENSORS = "keras_hub.src.utils.transformers.safetensor_utils"
_LOADER = f"{_SAFETENSORS}.SafetensorLoader"
_VARIABLE, _INITIALIZE = "keras.Variable", VARIABLE_INITIALIZE_METHOD
_BACKBONE, _TASK = "keras_hub.models.Backbone", "keras_hub.models.Task"
_LOADING = "keras_hub_autodist.loading.session"
_STORES = "keras_hub_autodist.saving.weight_stores"
_PLUGIN = "keras_hub_autodist.plugin"
_BINDING = "keras_hub_autodist.training.binding"
_BOUND_METHODS = "<each of binding.BOUND_METHODS>"
_FUSED = "_use_fused_attention_op"  # keras-hub attention: a fused kernel?
_JAX_NN, _FLASH = "keras.src.backend.jax.nn", "_can_use_flash_attention"
_CONTEXT = "keras_hub_autodist.planning.distribution"
_REMAT = "keras_hub_autodist.planning.remat"
_PER_DEVICE = "keras_hub_autodist.attention.context_attention"
# Each decoder block's mask method (`attention.DECODER_BLOCKS`).
_MASK_METHODS = "<each DecoderBlock.mask_method>"
_XLA_PATH = "keras_hub_autodist.attention.xla_path"
_RESUMABLE = "keras_hub_autodist.training.resumable"
PATCHES = (
    Patch("variable_assign", _VARIABLE, "assign", _LOADING, WHILE_LOADING),
    Patch("variable_initializer", _VARIABLE, _INITIALIZE, _LOADING, WHILE_LOADING),
    Patch("h5_store_read", _H5_STORE, "__getitem__", _LOADING, WHILE_LOADING),
    Patch("safetensors_open", _SAFETENSORS, "safetensors", _LOADING, WHILE_LOADING),
    Patch("safetensors_port_weight", _LOADER, "port_weight", _LOADING, WHILE_LOADING),
    Patch("h5_store_class", _SAVING_LIB, "H5IOStore", _STORES, WHILE_SAVING),
    Patch(
        "sharded_h5_store_class", _SAVING_LIB, "ShardedH5IOStore", _STORES, WHILE_SAVING
    ),
    Patch(
        "optimizer_save_variables",
        "keras.src.optimizers.base_optimizer.BaseOptimizer",
        "save_own_variables",
        _STORES,
        WHILE_SAVING,
    ),
    Patch("backbone_from_preset", _BACKBONE, "from_preset", _PLUGIN, WHILE_ACTIVE),
    Patch("task_from_preset", _TASK, "from_preset", _PLUGIN, WHILE_ACTIVE),
    Patch("bound_model_methods", None, _BOUND_METHODS, _BINDING, MODEL_LIFETIME),
    Patch("attention_through_xla", None, _FUSED, _XLA_PATH, MODEL_LIFETIME),
    Patch("rematerialized_blocks", None, "call", _REMAT, MODEL_LIFETIME),
    Patch(
        "attention_per_device", None, "_compute_attention", _PER_DEVICE, MODEL_LIFETIME
    ),
    Patch("decoder_block_masks", None, _MASK_METHODS, _PER_DEVICE, MODEL_LIFETIME),
    Patch("flash_attention_check", _JAX_NN, _FLASH, _CONTEXT, WHILE_CONTEXT),
    Patch("skipped_batches", None, "train_function", _RESUMABLE, WHILE_SKIPPING),
) + tuple(
    Patch(*fields)
    for module in (compat_steps, compat_devices, compat_upstream)
    for fields in module.PATCH_FIELDS
)
_PATCHES_BY_NAME = {patch.name: patch for patch in PATCHES}
_MISSING = object()
# Process-wide patches in place: name -> [contexts holding it, previous value].
_installed: dict[str, list] = {}
_patch_lock = threading.RLock()


def _registered(name: str, process_wide: bool) -> Patch:
    patch = _PATCHES_BY_NAME.get(name)
    if patch is None or patch.process_wide != process_wide:
        kind = "process-wide" if process_wide else "instance"
        known = [p.name for p in PATCHES if p.process_wide == process_wide]
        raise KeyError(
            f"{name!r} is not a registered {kind} patch: add it to "
            f"`compat.PATCHES`. Known: {known}"
        )
    return patch


def _own_attribute(holder, attribute):
    if isinstance(holder, type):
        return vars(holder).get(attribute, _MISSING)
    return getattr(holder, attribute, _MISSING)


def _resolve(path: str):
    """The object a dotted path names, as Keras and keras-hub define it: an
    attribute that one of our patches replaces resolves to the original."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
            break
        except ImportError:
            continue
    else:
        raise ImportError(f"No module of {path!r} can be imported")
    prefix = ".".join(parts[:split])
    for part in parts[split:]:
        prefix = f"{prefix}.{part}"
        with _patch_lock:
            replaced = next(
                (
                    _installed[patch.name][1]
                    for patch in PATCHES
                    if patch.name in _installed and patch.target == prefix
                ),
                _MISSING,
            )
        found = getattr(found, part) if replaced is _MISSING else replaced
    return found


@contextlib.contextmanager
def patched(replacements: dict):
    """Install process-wide patches (`PATCHES`) for the context's duration.

    Thread-safe and reference counted: the first context to enter installs a
    patch, the last to leave removes it, so overlapping contexts in several
    threads share one installation and none removes a patch from under
    another. Every patch is removed when the context exits, by an exception
    too.

    Args:
        replacements: patch name -> a function of the attribute being
            replaced that returns its replacement (called when installed).

    Example:
    ```python
    with patched({"variable_assign": lambda original: my_assign}):
        model = keras_hub.models.Backbone.from_preset(preset)
    ```
    """
    patches = [_registered(name, process_wide=True) for name in replacements]
    done = []

    def release():
        with _patch_lock:
            for patch in reversed(done):
                entry = _installed[patch.name]
                entry[0] -= 1
                if not entry[0]:
                    del _installed[patch.name]
                    _restore(patch, entry[1])

    with _patch_lock:
        try:
            for patch in patches:
                entry = _installed.get(patch.name)
                if entry is None:
                    holder = _resolve(patch.holder)
                    previous = _own_attribute(holder, patch.attribute)
                    original = getattr(holder, patch.attribute)
                    replacement = replacements[patch.name](original)
                    setattr(holder, patch.attribute, replacement)
                    entry = _installed[patch.name] = [0, previous]
                entry[0] += 1
                done.append(patch)
        except BaseException:
            release()
            raise
    try:
        yield
    finally:
        release()


def _restore(patch, previous):
    holder = _resolve(patch.holder)
    if previous is _MISSING:
        delattr(holder, patch.attribute)
    else:
        setattr(holder, patch.attribute, previous)


@contextlib.contextmanager
def answering_for(platform: str, device_kind: str = ""):
    """keras-hub's checks of the devices (`devices.CHECKING_MODULES`) answer
    for `platform` and `device_kind` in this context, and for this machine
    everywhere else: `with answering_for("tpu", "TPU v5 lite"): jit(...).lower(...)`.
    """
    with (
        patched(compat_devices.REPLACEMENTS),
        compat_devices.answering(platform, device_kind),
    ):
        yield


def installed_patches() -> dict[str, int]:
    """The process-wide patches in place, with how many contexts hold each.

    Example:
    >>> installed_patches()
    {}
    """
    with _patch_lock:
        return {name: entry[0] for name, entry in _installed.items()}


def set_patch(name: str, value) -> None:
    """Set a lasting process-wide patch (`plugin.activate`), or put the
    original back (`plugin.deactivate`)."""
    patch = _registered(name, process_wide=True)
    with _patch_lock:
        setattr(_resolve(patch.holder), patch.attribute, value)


# On a function `patch_instance` installed: the patch's name.
_INSTANCE_PATCH_ATTR = "__keras_hub_autodist_instance_patch__"


def patch_instance(name: str, obj, attribute: str, value) -> None:
    """Give one object a lasting attribute that replaces its class's, out of
    Keras' attribute tracking (`object.__setattr__`); a function is marked
    as this package's (`is_instance_patch`)."""
    _registered(name, process_wide=False)
    with contextlib.suppress(AttributeError, TypeError):
        setattr(value, _INSTANCE_PATCH_ATTR, name)
    object.__setattr__(obj, attribute, value)


def is_instance_patch(value) -> bool:
    """Whether `value` is a function `patch_instance` installed (not one a
    user put on the object).

    Example:
    >>> is_instance_patch(print)
    False
    """
    return _INSTANCE_PATCH_ATTR in (getattr(value, "__dict__", None) or {})


@contextlib.contextmanager
def instance_patched(name: str, obj, attribute: str, value):
    """`obj.attribute = value` for the context's duration; the previous
    value is put back on exit, by an exception too."""
    _registered(name, process_wide=False)
    previous = vars(obj).get(attribute, _MISSING)
    object.__setattr__(obj, attribute, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            object.__delattr__(obj, attribute)
        else:
            object.__setattr__(obj, attribute, previous)
