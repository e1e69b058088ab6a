"""keras-hub's checks of the devices, answered for the device a step is
compiled for.

Some of keras-hub's attention layers choose their path by the devices JAX
sees: Gemma, Gemma 3, Gemma 4, Mixtral and Qwen-MoE call Keras' fused
`dot_product_attention` on a TPU (soft cap included), on a GPU unless its
name is denied (a T4) or the logits are soft-capped, and their own einsum
attention elsewhere. A step compiled on this machine for a named
accelerator (`compiled_memory(..., device="v5e")`) must take the path that
accelerator takes, or the compiler is handed another program than the one
the accelerator will run. Inside `compat.answering_for(platform, device_kind)`,
these checks answer for that device in the calling thread (and its
contexts), and defer to keras-hub everywhere else.

Keras' own choice of a fused kernel inside `ops.dot_product_attention`
needs no answer: inside a compiled step keras-hub's mask is traced, so on a
TPU Keras falls back to `jax.nn.dot_product_attention`'s XLA path, the one
it takes on this machine; a GPU of compute capability 8.0 or more would take
cuDNN's kernel, which a compile-only GPU can't check (docs/concepts.md).
That fallback drops `attn_logits_soft_cap` (Gemma 2's attention soft cap):
the TPU's step has none. Keras refuses the argument unless JAX's own
devices are TPUs, so for a TPU it is dropped here as the TPU drops it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import NamedTuple

_KERAS_UTILS = "keras_hub.src.utils.keras_utils"
_MODELS = "keras_hub.src.models"
# keras-hub's modules that import `running_on_tpu`/`running_on_gpu` by
# name to choose an attention path (`tests/test_target_program.py` checks
# this list against every keras-hub module that does).
CHECKING_MODULES = tuple(
    f"{_MODELS}.{family}.{family}_attention"
    for family in ("gemma", "gemma3", "gemma4", "mixtral", "qwen_moe")
)
_RUNNING_ON = ("running_on_tpu", "running_on_gpu")
WHILE_COMPILING = "while a step is compiled for a named device in some thread"
_OWNER = "keras_hub_autodist.compat.devices"


class Device(NamedTuple):
    """The device a step is compiled for: its platform (`"tpu"`, `"gpu"`,
    `"cpu"`) and what JAX calls one of them (`"TPU v5 lite"`, `"Tesla T4"`)."""

    platform: str
    device_kind: str


# What each check answers for a device.
ANSWERS = {
    "running_on_tpu": lambda device: device.platform == "tpu",
    "running_on_gpu": lambda device: device.platform == "gpu",
    # keras-hub denies its fused path by the GPU's name (`"T4"`).
    "get_gpu_names": lambda device: (
        [device.device_kind] if device.platform == "gpu" else []
    ),
}
# Each (module, check) replaced: the checks as the attention modules
# imported them, the GPU's names as keras-hub's utilities read them, and
# Keras' attention as those modules call it (`keras.ops`).
TOUCHPOINTS = tuple(
    (module, check) for module in CHECKING_MODULES for check in _RUNNING_ON
) + ((_KERAS_UTILS, "get_gpu_names"), ("keras.ops", "dot_product_attention"))
# `compat.Patch` fields: (name, holder, attribute, owner, lasts).
PATCH_FIELDS = tuple(
    (
        f"device_check:{module.rsplit('.', 1)[-1]}.{check}",
        module,
        check,
        _OWNER,
        WHILE_COMPILING,
    )
    for module, check in TOUCHPOINTS
)

_DEVICE = contextvars.ContextVar("keras_hub_autodist_compiled_for", default=None)


def _answering(check: str):
    def replace(original):
        @functools.wraps(original)
        def answer(*args, **kwargs):
            device = _DEVICE.get()
            if device is None:
                return original(*args, **kwargs)
            return ANSWERS[check](device)

        return answer

    return replace


def _attention_as_on_the_device(original):
    @functools.wraps(original)
    def attention(*args, **kwargs):
        device = _DEVICE.get()
        if device is not None and device.platform == "tpu":
            kwargs.pop("attn_logits_soft_cap", None)  # the module's docstring
        return original(*args, **kwargs)

    return attention


# Patch name -> the function of Keras' or keras-hub's attribute that
# replaces it (`compat.patched`, installed by `compat.answering_for`).
REPLACEMENTS = {
    name: _attention_as_on_the_device
    if check == "dot_product_attention"
    else _answering(check)
    for name, _, check, *_ in PATCH_FIELDS
}


@contextlib.contextmanager
def answering(platform: str, device_kind: str = "") -> Iterator[None]:
    """The checks replaced by `REPLACEMENTS` answer for `platform` in this
    context (`compat.answering_for` installs them around it).

    Args:
        platform: the platform of the devices a step is compiled for.
        device_kind: what JAX calls one of them.
    """
    token = _DEVICE.set(Device(platform, device_kind))
    try:
        yield
    finally:
        _DEVICE.reset(token)


@functools.cache
def cudnn_version() -> int | None:
    """The version of the cuDNN that JAX lowers its fused attention with, or
    None where JAX finds none: a GPU machine has it (JAX's CUDA wheels); a
    compile for a named GPU elsewhere has it with the `nvidia-cudnn-cu12`
    wheel installed."""
    from jax._src.cudnn import fused_attention_stablehlo

    try:
        return int(fused_attention_stablehlo.check_cudnn_version())
    except (RuntimeError, ImportError):
        return None
