"""Named devices: the memory one device of a kind has, as data.

`plan(device_memory="t4")` and the CLI's `--device t4` plan for that
device's memory, and the answer names it. The memory is per device as JAX
sees it: a TPU v3-8 is eight cores of 16 GiB each, a v4 or v5p chip one
device.
"""

from __future__ import annotations

import dataclasses

from keras_hub_autodist.errors import PlanError

GIB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One kind of device.

    Args:
        name: what `--device` takes, e.g. `"t4"`.
        memory_bytes: memory per JAX device.
        platform: `"gpu"` or `"tpu"`, whose compiler's buffers the
            activation estimate counts (`memory_factors.ACTIVATION_FACTORS`).
        description: the device in words, for the answer.

    Example:
    >>> DEVICE_PROFILES["t4"].memory_bytes // GIB
    16
    """

    name: str
    memory_bytes: int
    platform: str
    description: str


DEVICE_PROFILES = {
    profile.name: profile
    for profile in (
        DeviceProfile("t4", 16 * GIB, "gpu", "NVIDIA T4, 16 GiB"),
        DeviceProfile("l4", 24 * GIB, "gpu", "NVIDIA L4, 24 GiB"),
        DeviceProfile("a100-40", 40 * GIB, "gpu", "NVIDIA A100, 40 GiB"),
        DeviceProfile("a100-80", 80 * GIB, "gpu", "NVIDIA A100, 80 GiB"),
        DeviceProfile("h100", 80 * GIB, "gpu", "NVIDIA H100, 80 GiB"),
        DeviceProfile("h200", 141 * GB, "gpu", "NVIDIA H200, 141 GB"),
        DeviceProfile("v3-8", 16 * GIB, "tpu", "TPU v3 core, 16 GiB (v3-8: 8 cores)"),
        DeviceProfile("v4", 32 * GIB, "tpu", "TPU v4 chip, 32 GiB"),
        DeviceProfile("v5e", 16 * GIB, "tpu", "TPU v5e chip, 16 GiB"),
        DeviceProfile("v5p", 95 * GIB, "tpu", "TPU v5p chip, 95 GiB"),
        DeviceProfile("v6e", 32 * GIB, "tpu", "TPU v6e (Trillium) chip, 32 GiB"),
    )
}


def device_profile(name: str) -> DeviceProfile:
    """The profile of a named device, case and spaces ignored.

    Raises:
        PlanError: for a name not in `DEVICE_PROFILES`.

    Example:
    >>> device_profile("V3-8").platform
    'tpu'
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DEVICE_PROFILES:
        raise PlanError(
            f"Unknown device {name!r}: name one of {sorted(DEVICE_PROFILES)}, "
            "or give the memory per device as a number of bytes "
            f"(`device_memory=16 * 1024**3`). Received: device_memory={name!r}"
        )
    return DEVICE_PROFILES[key]
