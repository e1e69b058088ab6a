"""What a compiled program says about itself: XLA's cost analysis, the
collectives and the attention kernel in its HLO text, the figures of a
compiler's refusal to fit it in memory, and a refusal for any other reason
as the package's error with its fix.

Reads text and dictionaries only; imports nothing beyond the standard
library and the package's errors.
"""

from __future__ import annotations

import dataclasses
import re

from keras_hub_autodist.errors import TargetCompileError

# XLA's collective operations, as HLO names them; the asynchronous ones are
# `<kind>-start` / `<kind>-done` pairs, counted once by their `-done`
# (whose shape is the result).
COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)
_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>" + "|".join(COLLECTIVE_KINDS) + r")(?P<phase>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
# Bits per element of HLO's element types.
_BITS = {
    "pred": 8,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
# Attention kernels, by a word of the custom call (or Pallas kernel name)
# that runs them -> the name the answer gives. First match wins.
ATTENTION_KERNELS = (
    ("splash", "splash"),
    ("flash_attention", "flash"),
    ("__cudnn$fmha", "cudnn_flash"),
    ("cudnn$fmha", "cudnn_flash"),
    ("ragged_paged_attention", "ragged_paged_attention"),
    ("paged_attention", "paged_attention"),
)
_CUSTOM_CALL = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_KERNEL_NAME = re.compile(r'"(?:kernel_name|name)"\s*:\s*"(?P<name>[^"]+)"')
# A Pallas kernel's custom call is named after its kernel in the program:
# `%splash_mqa_fwd.1 = (...) custom-call(...), custom_call_target="tpu_custom_call"`.
_CALL_NAME = re.compile(
    r"%(?P<name>[\w.-]+) = [^\n]*custom_call_target=\"tpu_custom_call\""
)
# The compiler's own figures when a program does not fit, e.g. (TPU)
# "the total memory required for HLO temporaries (48.00G) exceeds available
# HBM (15.75G)" or "Used 20.95G of 15.48G hbm". Both name the program's
# whole need, its arguments included: libtpu refuses a step whose 17 GiB
# of arguments feed no temporary with "the total memory required for HLO
# temporaries (17.00G)".
_REQUIRED = re.compile(
    r"required for [^(]*\((?P<used>[0-9.]+)(?P<u1>[KMGT]?)\)\s*exceeds available "
    r"\w+\s*\((?P<limit>[0-9.]+)(?P<u2>[KMGT]?)\)"
)
_USED_OF = re.compile(
    r"Used (?P<used>[0-9.]+)(?P<u1>[KMGT]?) of (?P<limit>[0-9.]+)(?P<u2>[KMGT]?) hbm"
)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


@dataclasses.dataclass(frozen=True)
class Collective:
    """The collectives of one kind in a compiled program, per device.

    Args:
        kind: HLO's name, e.g. `"all-gather"`.
        count: how many the program runs (each once per step).
        bytes: the bytes their results hold, summed.
    """

    kind: str
    count: int
    bytes: int


def array_bytes(shape: str) -> int:
    """Bytes of an HLO shape, a tuple's elements summed.

    Example:
    >>> array_bytes("(bf16[4,8]{1,0}, f32[2])")
    72
    """
    total = 0
    for match in _ARRAY.finditer(shape):
        dims = [int(d) for d in match["dims"].split(",") if d]
        count = 1
        for dim in dims:
            count *= dim
        total += count * _BITS.get(match["dtype"], 32) // 8
    return total


def collectives(hlo_text: str) -> tuple[Collective, ...]:
    """The collectives of a compiled program's HLO text, by kind.

    Example:
    >>> text = "%a = f32[1024]{0} all-reduce(%x), replica_groups={}"
    >>> collectives(text)
    (Collective(kind='all-reduce', count=1, bytes=4096),)
    """
    counts: dict[str, list[int]] = {}
    for match in _COLLECTIVE.finditer(hlo_text):
        if match["phase"] == "-start":
            continue
        entry = counts.setdefault(match["kind"], [0, 0])
        entry[0] += 1
        entry[1] += array_bytes(match["shape"])
    return tuple(
        Collective(kind, *counts[kind]) for kind in COLLECTIVE_KINDS if kind in counts
    )


def attention_kernel(hlo_text: str) -> str:
    """The attention a compiled program runs: a fused kernel's name
    (`"splash"`, `"cudnn_flash"`, ...) when one of its custom calls is one,
    else `"xla"` (attention as XLA's own matmuls and softmax).

    Example:
    >>> attention_kernel('custom_call_target="__cudnn$fmhaSoftmax"')
    'cudnn_flash'
    >>> attention_kernel(
    ...     '%splash_mqa_fwd.1 = f32[8] custom-call(%q), '
    ...     'custom_call_target="tpu_custom_call"'
    ... )
    'splash'
    >>> attention_kernel("%dot = f32[8,8] dot(%q, %k)")
    'xla'
    """
    names = [m["target"] for m in _CUSTOM_CALL.finditer(hlo_text)]
    names += [m["name"] for m in _KERNEL_NAME.finditer(hlo_text)]
    names += [m["name"] for m in _CALL_NAME.finditer(hlo_text)]
    for name in names:
        lowered = name.lower()
        for word, answer in ATTENTION_KERNELS:
            if word in lowered:
                return answer
    return "xla"


def cost_figures(cost) -> dict:
    """XLA's cost analysis as per-device figures: `flops`, `bytes_accessed`
    and, where the backend gives one, `optimal_seconds` (the TPU
    compiler's time estimate); `{}` when the backend gives none.

    Example:
    >>> cost_figures({"flops": 2.0, "bytes accessed": 8.0})
    {'flops': 2.0, 'bytes_accessed': 8.0}
    """
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    if not cost:
        return {}
    figures = {}
    for name, key in (
        ("flops", "flops"),
        ("bytes_accessed", "bytes accessed"),
        ("optimal_seconds", "optimal_seconds"),
    ):
        if cost.get(key) is not None and cost[key] >= 0:
            figures[name] = float(cost[key])
    return figures


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """A compiler's refusal of a program too large for the device, as
    `(bytes needed, bytes available)` per device: the figures the refusal
    names, the program's whole need (its arguments included) against the
    memory the compiler gives a program; `(0, 0)` for a refusal whose
    figures can't be read; None for any other error.

    Example:
    >>> out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Used 2.00G of 1.00G hbm"))
    (2147483648, 1073741824)
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    match = _USED_OF.search(text) or _REQUIRED.search(text)
    if match is None:
        return (0, 0)
    return (
        int(float(match["used"]) * _UNITS[match["u1"]]),
        int(float(match["limit"]) * _UNITS[match["u2"]]),
    )


# Compiler refusals that are not about memory: words of the compiler's
# message, and what makes the step compile. A T4 (compute capability 7.5)
# has no bfloat16 matrix arithmetic, and `jax.nn.dot_product_attention`,
# which Keras' attention calls, asks for bfloat16 dots with float32
# accumulation for bfloat16 inputs (keras-team/keras#21112: the same
# refusal on a real T4).
REFUSAL_ADVICE = (
    (
        "ALG_DOT_BF16_BF16_F32",
        "this device has no bfloat16 matrix arithmetic for the attention that "
        'Keras runs (keras-team/keras#21112); train in `dtype="float16"` (a '
        'T4\'s half type) or `dtype="float32"`',
    ),
)


def refusal_advice(error: BaseException) -> str:
    """What makes a step the compiler refused (for a reason other than its
    size) compile, from `REFUSAL_ADVICE`; "" when the refusal is not known.

    Example:
    >>> refused = RuntimeError("Unsupported algorithm: ALG_DOT_BF16_BF16_F32")
    >>> refusal_advice(refused).startswith("this device has no bfloat16")
    True
    >>> refusal_advice(RuntimeError("INTERNAL: something else"))
    ''
    """
    text = str(error)
    return next((advice for words, advice in REFUSAL_ADVICE if words in text), "")


def not_compiled(error: BaseException, dtype: str, fields: dict) -> TargetCompileError:
    """The compiler's refusal of a step for a reason other than its size,
    as the package's error: what was compiled (`fields`, a
    `CompiledMemory`'s), the compiler's words, and what makes it compile
    where that is known (`refusal_advice`)."""
    words = (str(error).strip() or type(error).__name__).splitlines()[0][:300]
    advice = refusal_advice(error)
    fix = (
        f"To make it compile: {advice}."
        if advice
        else "The same step fails on that device; change the dtype, the "
        "model or the mesh."
    )
    return TargetCompileError(
        f"XLA's compiler for {_devices(fields)} refuses the training step, not "
        f"for its size: {words}. {fix} {_received(dtype, fields)}"
    )


def leaked_trace_error(leaked: list, dtype: str, fields: dict) -> TargetCompileError:
    """The step's refusal by JAX for values of a finished trace among its
    constants (`leaked`, tracers): XLA compiles such a program, and its
    first call on any device fails (`UnexpectedTracerError`), so the
    target's verdict is that refusal, not a size."""
    shapes = ", ".join(sorted({str(value.aval) for value in leaked}))
    return TargetCompileError(
        f"The training step can't run on {_devices(fields)}: its program holds "
        f"{len(leaked)} value(s) of a JAX trace that had ended ({shapes}), "
        "which JAX refuses at the step's first call (UnexpectedTracerError). A "
        "function of the step closes over a traced value and is traced again "
        "after that trace (a custom VJP recomputed by remat, a cache): pass "
        "the value as an argument (jax.closure_convert); if the function is "
        f"keras-hub-autodist's, report it with the step below. "
        f"{_received(dtype, fields)}"
    )


def _devices(fields: dict) -> str:
    """The compiled-for devices of `fields` (a `CompiledMemory`'s), as the
    refusals name them: `"TPU v5 lite x 1"`."""
    return f"{fields['device_kind'] or fields['platform']} x {fields['devices']}"


def _received(dtype: str, fields: dict) -> str:
    """The step a refusal was given, as its message ends."""
    return (
        f"Received: dtype={dtype!r}, "
        f"device={fields['target'] or 'this machine'!r}, "
        f"batch_size={fields['batch_size']}, "
        f"sequence_length={fields['sequence_length']}"
    )


__all__ = [
    "Collective",
    "array_bytes",
    "attention_kernel",
    "collectives",
    "cost_figures",
    "leaked_trace_error",
    "not_compiled",
    "out_of_memory",
    "refusal_advice",
]
