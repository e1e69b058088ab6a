"""The dtype a model's variables will have, read without importing Keras
where the policy is a plain name."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

from keras_hub_autodist.errors import DTypeError

# Bytes per element of the dtypes weights come in, read without numpy.
ITEMSIZES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of `dtype` (0 for a weight whose dtype is not known
    yet).

    Example:
    >>> itemsize("bfloat16")
    2
    """
    if not dtype:
        return 0
    if dtype in ITEMSIZES:
        return ITEMSIZES[dtype]
    import ml_dtypes
    import numpy as np

    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_MIXED_POLICIES = ("mixed_float16", "mixed_bfloat16")
# Every dtype a model may be loaded with: Keras' float policies and its
# mixed-precision policies (float32 variables, a 16-bit compute dtype).
ACCEPTED_DTYPES = _FLOAT_DTYPES + _MIXED_POLICIES


def _accepted_policy_name(dtype) -> str | None:
    """The name of `dtype` when it is one of `ACCEPTED_DTYPES` (as a name, a
    plain `keras.DTypePolicy` or its serialized form); `None` otherwise."""
    name = _policy_name(dtype)
    if name is None:
        keras = sys.modules.get("keras")
        policy_class = getattr(keras, "DTypePolicy", None)
        plain = (
            policy_class is not None
            and isinstance(dtype, policy_class)
            and getattr(dtype, "quantization_mode", None) is None
            and not hasattr(dtype, "policy_map")
        )
        name = dtype.name if plain else None
    return name if name in ACCEPTED_DTYPES else None


def check_dtype(dtype):
    """`dtype=` as a user passes it to `from_preset`, `plan` or `--dtype`,
    checked: `None`, a float dtype name or a Keras mixed-precision policy (a
    name, a plain `keras.DTypePolicy` or its serialized form). Returned
    unchanged.

    Integer, boolean, string and quantized dtypes are refused: Keras would
    cast every float weight to them (an integer model of zeros) or fail with
    its own error.

    Raises:
        DTypeError: for anything else, listing what is accepted.

    Example:
    >>> check_dtype("mixed_bfloat16")
    'mixed_bfloat16'
    """
    if dtype is None or _accepted_policy_name(dtype) is not None:
        return dtype
    shown = repr(dtype)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise DTypeError(
        "`dtype` is the float dtype or mixed-precision policy the model is "
        f"loaded with: one of {list(ACCEPTED_DTYPES)}, or a "
        "`keras.DTypePolicy` of one of them. Integer, boolean and quantized "
        "dtypes are not load dtypes (to quantize, load in a float dtype and "
        'call `model.quantize("int8")`). Received: '
        f"dtype={shown} of type {type(dtype).__name__}"
    )


def global_policy_name() -> str:
    """The name of Keras' global dtype policy (`keras.config.dtype_policy()`),
    read without importing Keras when it isn't imported (then `floatx()`).

    Example:
    >>> global_policy_name() in ACCEPTED_DTYPES
    True
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        return str(keras.config.dtype_policy().name)
    return floatx()


def loaded_policy(config: Mapping, dtype=None, *, preset_files: bool):
    """The dtype policy the backbone is built with: keras-hub's own rule.

    `dtype` (as passed to `from_preset`) wins. Without it, keras-hub's
    `from_preset` builds a preset read from files (Keras or Hugging Face) in
    Keras' global policy, whatever float dtype it was saved in; a saved
    policy that is not a plain float one (a quantized policy map) is kept.
    A config dict or an instance (`preset_files=False`) keeps its own
    `dtype`, as building it does.

    Args:
        config: the backbone's constructor arguments.
        dtype: `dtype=` as passed, or `None`.
        preset_files: whether the config was read from a preset's files.

    Example:
    >>> loaded_policy({"dtype": "float16"}, preset_files=False)
    'float16'
    """
    if dtype is not None:
        return dtype
    saved = config.get("dtype")
    if preset_files and (saved is None or _policy_name(saved) in ACCEPTED_DTYPES):
        return global_policy_name()
    return saved


def floatx() -> str:
    """Keras' `floatx()`, read from `keras.json` while Keras isn't imported.

    Example:
    >>> floatx() in ("float16", "float32", "float64")
    True
    """
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "config"):
        return keras.config.floatx()
    if "KERAS_HOME" in os.environ:
        folder = os.environ["KERAS_HOME"]
    else:
        folder = os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(folder, "keras.json"), encoding="utf-8") as file:
            value = json.load(file).get("floatx", "float32")
    except (OSError, ValueError, AttributeError):
        return "float32"
    return value if value in ("float16", "float32", "float64") else "float32"


def _policy_name(policy):
    """The name of a simple policy given as a string or Keras' serialized
    form; `None` for anything Keras must interpret."""
    if isinstance(policy, str):
        return policy
    if (
        isinstance(policy, Mapping)
        and policy.get("module") == "keras"
        and policy.get("class_name") == "DTypePolicy"
        and isinstance(policy.get("config"), Mapping)
        and isinstance(policy["config"].get("name"), str)
    ):
        return policy["config"]["name"]
    return None


def mixed_policy(config: Mapping, dtype=None) -> str:
    """The mixed-precision policy the backbone computes with
    (`"mixed_bfloat16"`, `"mixed_float16"`: float32 variables, a 16-bit
    compute dtype), read as `variable_dtype` reads the variables' dtype;
    `""` for a plain float dtype.

    Example:
    >>> mixed_policy({}, "mixed_bfloat16"), mixed_policy({"dtype": "bfloat16"})
    ('mixed_bfloat16', '')
    """
    policy = dtype if dtype is not None else config.get("dtype")
    name = _policy_name(policy)
    if name is None and hasattr(policy, "name"):
        name = _accepted_policy_name(policy)
    return name if name in _MIXED_POLICIES else ""


def variable_dtype(config: Mapping, dtype=None) -> str:
    """The dtype the backbone's variables will have.

    `dtype` (as passed to `from_preset`) wins over the config's own `dtype`;
    without either, Keras' `floatx()` applies. Mixed policies such as
    `"mixed_bfloat16"` keep float32 variables. Float dtypes and mixed
    policies are read without importing Keras.

    Raises:
        DTypeError: for anything that is not a dtype or dtype policy.

    Example:
    >>> variable_dtype({}, "mixed_bfloat16")
    'float32'
    """
    policy = dtype if dtype is not None else config.get("dtype")
    if policy is None:
        return floatx()
    name = _policy_name(policy)
    if name in _FLOAT_DTYPES:
        return name
    if name in _MIXED_POLICIES:
        return "float32"
    source = "dtype" if dtype is not None else "the preset's config dtype"
    if not isinstance(policy, (str, Mapping)) and not hasattr(policy, "variable_dtype"):
        raise DTypeError(
            f"{source} must be a dtype name such as 'bfloat16', a policy "
            "name such as 'mixed_bfloat16', or a `keras.DTypePolicy`. "
            f"Received: dtype={policy!r} of type {type(policy).__name__}"
        )
    import keras

    try:
        if isinstance(policy, Mapping):
            policy = keras.dtype_policies.deserialize(dict(policy))
        if isinstance(policy, str):
            policy = keras.DTypePolicy(policy)
        return str(policy.variable_dtype)
    except (TypeError, ValueError, AttributeError) as error:
        raise DTypeError(
            f"{source} is not a dtype or dtype policy Keras knows ({error}). "
            "Use e.g. 'bfloat16', 'float32' or 'mixed_bfloat16'. Received: "
            f"dtype={policy!r}"
        ) from error


def is_quantized(config: Mapping) -> bool:
    """Whether a backbone config carries a quantized dtype policy map.

    Example:
    >>> is_quantized({"dtype": "float32"})
    False
    """
    dtype = config.get("dtype")
    if not isinstance(dtype, Mapping):
        return False
    policies = dtype.get("config", {}).get("policy_map", {})
    return any(
        "Quantized" in str(policy.get("class_name", ""))
        for policy in policies.values()
        if isinstance(policy, Mapping)
    )
