"""Named devices: the memory one device of a kind has, as data.

`plan(device_memory="t4")` and the CLI's `--device t4` plan for that
device's memory, and the answer names it. The memory is per device as JAX
sees it (a TPU v3-8 is eight cores of 16 GiB each, a v5p chip one device),
and it is what JAX can allocate there, not the whole: JAX's pool of 75% of
a GPU's memory by default, the HBM the TPU compiler gives a program
(`usable_memory` says which, with the environment's settings). Each number
names its source.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from keras_hub_autodist.errors import EnvironmentVariableError
from keras_hub_autodist.errors import PlanError

GIB = 1024**3
MIB = 1024**2
GB = 1000**3


# JAX's GPU memory pool: the fraction of a GPU's memory JAX may allocate by
# default, and the variables that change it (jaxlib/xla_client.py reads
# them when it starts the GPU client; XLA_PYTHON_CLIENT_MEM_FRACTION is the
# older name of XLA_CLIENT_MEM_FRACTION). XLA_PYTHON_CLIENT_PREALLOCATE=false
# only defers the pool's allocation: its limit stays the fraction (JAX's
# "GPU memory allocation" page). XLA_PYTHON_CLIENT_ALLOCATOR=platform has
# no pool: every buffer is its own cudaMalloc, up to the whole memory.
GPU_POOL_FRACTION = 0.75
GPU_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
GPU_ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One kind of device.

    Args:
        name: what `--device` takes, e.g. `"t4"`.
        memory_bytes: memory per JAX device that JAX can allocate by
            default: on a GPU `GPU_POOL_FRACTION` of `total_bytes` (JAX's
            pool), on a TPU the HBM the TPU compiler gives a program.
        platform: `"gpu"` or `"tpu"`, whose compiler's buffers the
            activation estimate counts (`memory_factors.ACTIVATION_FACTORS`).
        description: the device in words, for the answer.
        total_bytes: the device's whole memory (per JAX device).
        source: where `total_bytes` and `memory_bytes` come from.

    Example:
    >>> DEVICE_PROFILES["t4"].total_bytes // GIB
    15
    """

    name: str
    memory_bytes: int
    platform: str
    description: str
    total_bytes: int = 0
    source: str = ""


def _gpu(name, total_bytes, description, source):
    usable = int(total_bytes * GPU_POOL_FRACTION)
    return DeviceProfile(name, usable, "gpu", description, total_bytes, source)


def _tpu(name, usable_bytes, total_bytes, description):
    source = (
        "the HBM the TPU compiler (libtpu 0.0.42.1, as jax[tpu] 0.10.2 pins "
        "it) gives one program on this device, as its refusal of a larger "
        "one reads"
    )
    return DeviceProfile(name, usable_bytes, "tpu", description, total_bytes, source)


_NVIDIA_SMI = "the memory nvidia-smi shows"
_XLA_SPEC = "device_memory_size of XLA's target config (gpu_targets/{}.txtpb)"

DEVICE_PROFILES = {
    profile.name: profile
    for profile in (
        _gpu("t4", 15360 * MIB, "NVIDIA T4, 15 GiB", f"{_NVIDIA_SMI} (15360 MiB)"),
        _gpu("l4", 23034 * MIB, "NVIDIA L4, 22.5 GiB", f"{_NVIDIA_SMI} (23034 MiB)"),
        _gpu(
            "a100-40",
            42331013120,
            "NVIDIA A100 SXM, 40 GB",
            _XLA_SPEC.format("a100-40"),
        ),
        _gpu(
            "a100-80",
            85100068864,
            "NVIDIA A100 SXM, 80 GB",
            _XLA_SPEC.format("a100-80"),
        ),
        _gpu("h100", 84942979072, "NVIDIA H100 SXM, 80 GB", _XLA_SPEC.format("h100")),
        _gpu("h200", 151397597184, "NVIDIA H200, 141 GB", _XLA_SPEC.format("h200")),
        _tpu(
            "v3-8",
            int(15.48 * GIB),
            16 * GIB,
            "TPU v3 core, 16 GiB HBM (v3-8: 8 cores)",
        ),
        _tpu(
            "v4",
            int(15.25 * GIB),
            16 * GIB,
            "TPU v4 TensorCore, 16 GiB HBM (the compiler's devices are the "
            "chip's two cores, not the 32 GiB megacore JAX shows on a v4 VM)",
        ),
        _tpu("v5e", int(15.75 * GIB), 16 * GIB, "TPU v5e chip, 16 GiB HBM"),
        _tpu("v5p", int(95.74 * GIB), 96 * GIB, "TPU v5p chip, 95 GiB HBM"),
        _tpu(
            "v6e",
            int(31.25 * GIB),
            32 * GIB,
            "TPU v6e (Trillium) chip, 32 GiB HBM",
        ),
    )
}


def usable_memory(
    profile: DeviceProfile, environ: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """The memory JAX can allocate on one device of `profile`, and the
    assumption in words: on a GPU, JAX's pool as the environment sets it
    (`XLA_CLIENT_MEM_FRACTION`, `XLA_PYTHON_CLIENT_ALLOCATOR`); on a TPU,
    the HBM the compiler gives a program.

    Args:
        profile: a `DeviceProfile`.
        environ: the environment to read (default `os.environ`): the
            variables of the process that will run the step.

    Raises:
        EnvironmentVariableError: for a fraction that is not a number in
            (0, 1].

    Example:
    >>> for part in usable_memory(DEVICE_PROFILES["t4"], {})[1].split("; "):
    ...     print(part)
    11.2 GiB: JAX's default 75% of a T4's 15 GiB
    set XLA_CLIENT_MEM_FRACTION=.95 for 14.2 GiB
    """
    environ = os.environ if environ is None else environ
    short = profile.name.upper()
    total = profile.total_bytes
    if profile.platform != "gpu":
        return profile.memory_bytes, (
            f"{profile.memory_bytes / GIB:.2f} GiB: {profile.source}, of a "
            f"{profile.description}"
        )
    if environ.get(GPU_ALLOCATOR_ENV, "").strip().lower() == "platform":
        return total, (
            f"{total / GIB:.1f} GiB: all of a {short}'s memory "
            f"({GPU_ALLOCATOR_ENV}=platform: no pool)"
        )
    for name in GPU_FRACTION_ENV:
        text = environ.get(name, "").strip()
        if text:
            fraction = _fraction(name, text)
            return int(total * fraction), (
                f"{total * fraction / GIB:.1f} GiB: {fraction:.0%} of a "
                f"{short}'s {total / GIB:.3g} GiB ({name}={text})"
            )
    return profile.memory_bytes, (
        f"{profile.memory_bytes / GIB:.1f} GiB: JAX's default "
        f"{GPU_POOL_FRACTION:.0%} of a {short}'s {total / GIB:.3g} GiB; set "
        f"{GPU_FRACTION_ENV[0]}=.95 for {total * 0.95 / GIB:.1f} GiB"
    )


def _fraction(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise EnvironmentVariableError(
            f"${name} is the fraction of a GPU's memory JAX may allocate, a "
            f"number above 0 and at most 1, e.g. .95. Received: {name}={text!r}"
        )
    return value


def device_key(name):
    """A device or platform name as the tables key it: case and spaces
    ignored (anything but a string as it is, for the lookup to refuse).

    Example:
    >>> device_key(" V3-8 ")
    'v3-8'
    """
    return name.strip().lower() if isinstance(name, str) else name


def look_up(table: dict, name, refusal: str):
    """`table`'s entry for the device `name` (`device_key`); a `PlanError`
    of `refusal` (formatted with `name` and `known`, the table's names)
    for a name it lacks.

    Example:
    >>> look_up({"t4": 1}, " T4", "Unknown {name!r}")
    1
    """
    key = device_key(name)
    if key not in table:
        raise PlanError(refusal.format(name=name, known=sorted(table)))
    return table[key]


def device_profile(name: str) -> DeviceProfile:
    """The profile of a named device, case and spaces ignored.

    Raises:
        PlanError: for a name not in `DEVICE_PROFILES`.

    Example:
    >>> device_profile("V3-8").platform
    'tpu'
    """
    return look_up(
        DEVICE_PROFILES,
        name,
        "Unknown device {name!r}: name one of {known}, or give the memory per "
        "device as a number of bytes (`device_memory=16 * 1024**3`). "
        "Received: device_memory={name!r}",
    )


@dataclasses.dataclass(frozen=True)
class DeviceSpeed:
    """How fast one device of a kind computes and moves bytes: the data of
    the step-time roofline (`searching.step_cost`).

    Args:
        peak_flops: dense 16-bit matrix flops per second of one JAX device,
            as it runs bfloat16 (a T4 has no bfloat16 tensor cores: XLA
            computes bfloat16 in float32 there).
        hbm_bytes_per_second: memory bandwidth of one JAX device.
        link_bytes_per_second: what one device sends to the others per
            second over `link` (one direction, all its links together).
        link: `"ici"` (TPU inter-chip interconnect), `"nvlink"` or
            `"pcie"`.
        source: where the numbers come from.
    """

    peak_flops: float
    hbm_bytes_per_second: float
    link_bytes_per_second: float
    link: str
    source: str


_NVIDIA_SHEET = "NVIDIA's datasheet of the {}"
_TPU_DOCS = "Google Cloud's TPU {} page (per chip; a v3/v4 JAX device is one core)"

# Per JAX device. TPU v3 and v4 chips are two TensorCores each, which the
# compiler sees as two devices: half a chip's figures each.
DEVICE_SPEEDS = {
    # 65 TFLOP/s is float16 on tensor cores; bfloat16 runs in float32
    # (8.1 TFLOP/s). 320 GB/s GDDR6; PCIe 3.0 x16 (16 GB/s), no NVLink.
    "t4": DeviceSpeed(8.1e12, 320e9, 16e9, "pcie", _NVIDIA_SHEET.format("T4")),
    # 121 TFLOP/s bfloat16 dense, 300 GB/s, PCIe 4.0 x16 (32 GB/s).
    "l4": DeviceSpeed(121e12, 300e9, 32e9, "pcie", _NVIDIA_SHEET.format("L4")),
    # 312 TFLOP/s bfloat16 dense; 1555 / 2039 GB/s; NVLink 3: 600 GB/s
    # both directions.
    "a100-40": DeviceSpeed(
        312e12, 1555e9, 300e9, "nvlink", _NVIDIA_SHEET.format("A100")
    ),
    "a100-80": DeviceSpeed(
        312e12, 2039e9, 300e9, "nvlink", _NVIDIA_SHEET.format("A100")
    ),
    # 989 TFLOP/s bfloat16 dense; 3.35 / 4.8 TB/s; NVLink 4: 900 GB/s
    # both directions.
    "h100": DeviceSpeed(
        989e12, 3350e9, 450e9, "nvlink", _NVIDIA_SHEET.format("H100 SXM")
    ),
    "h200": DeviceSpeed(989e12, 4800e9, 450e9, "nvlink", _NVIDIA_SHEET.format("H200")),
    # v3 chip: 123 TFLOP/s, 900 GB/s, ICI 656 Gbit/s (82 GB/s); per core.
    "v3-8": DeviceSpeed(61.5e12, 450e9, 41e9, "ici", _TPU_DOCS.format("v3")),
    # v4 chip: 275 TFLOP/s, 1200 GB/s, ICI 2400 Gbit/s (300 GB/s); per core.
    "v4": DeviceSpeed(137.5e12, 600e9, 150e9, "ici", _TPU_DOCS.format("v4")),
    # v5e chip: 197 TFLOP/s, 819 GB/s, ICI 1600 Gbit/s (200 GB/s).
    "v5e": DeviceSpeed(197e12, 819e9, 200e9, "ici", _TPU_DOCS.format("v5e")),
    # v5p chip: 459 TFLOP/s, 2765 GB/s, ICI 4800 Gbit/s (600 GB/s).
    "v5p": DeviceSpeed(459e12, 2765e9, 600e9, "ici", _TPU_DOCS.format("v5p")),
    # v6e chip: 918 TFLOP/s, 1640 GB/s, ICI 3584 Gbit/s (448 GB/s).
    "v6e": DeviceSpeed(918e12, 1640e9, 448e9, "ici", _TPU_DOCS.format("v6e")),
}


# Devices without bfloat16 arithmetic, whose compiler computes a bfloat16
# model in float32 copies of its tensors (a T4, compute capability 7.5):
# float16 there holds half those copies' bytes.
FLOAT32_FOR_BFLOAT16 = ("t4",)


def device_speed(name: str) -> DeviceSpeed:
    """The `DeviceSpeed` of a named device, case and spaces ignored.

    Raises:
        PlanError: for a name not in `DEVICE_SPEEDS`.

    Example:
    >>> device_speed("V5E").link
    'ici'
    """
    return look_up(
        DEVICE_SPEEDS,
        name,
        "No speed figures for device {name!r}: name one of {known}. "
        "Received: device={name!r}",
    )
