"""What each device has: the per-device memory planning assumes, and where
it comes from (given, the environment, reported by the devices, assumed)."""

from __future__ import annotations

import math
import os

from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.fitting.device_profiles import GIB
from keras_hub_autodist.fitting.device_profiles import device_profile
from keras_hub_autodist.fitting.device_profiles import usable_memory
from keras_hub_autodist.planning.options import device_memory_bytes
from keras_hub_autodist.planning.plan_record import MEMORY_ASSUMED
from keras_hub_autodist.planning.plan_record import MEMORY_ENV
from keras_hub_autodist.planning.plan_record import MEMORY_GIVEN
from keras_hub_autodist.planning.plan_record import MEMORY_REPORTED

GB = 1000**3
# The per-device memory in GiB, like the CLI's `--device-memory`.
DEVICE_MEMORY_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB"
# The same in gigabytes (10^9 bytes), as its name says.
DEVICE_MEMORY_GB_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB"
# Per-device memory assumed when the backend reports none (CPU, or planning
# for a mesh given as a mapping): 16 GiB, as on a T4 or a TPU v3 core.
DEFAULT_DEVICE_MEMORY_BYTES = 16 * GIB


def device_memory_info(devices=(), override=None) -> tuple[int, str]:
    """Per-device memory for planning, and where it comes from.

    In order: `override` (`"given"`); `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB`
    (GiB) or `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB` (10^9 bytes) (`"env"`):
    what you state wins over what the devices report; the smallest
    `bytes_limit` that `devices` report (`"reported"`); else
    `DEFAULT_DEVICE_MEMORY_BYTES`, 16 GiB (`"assumed"`).

    Args:
        devices: JAX devices to ask (only this process's devices answer).
        override: bytes to use as-is, or a device name of
            `device_profiles.DEVICE_PROFILES` (the memory JAX can allocate
            there, `device_profiles.usable_memory`).

    Example:
    >>> device_memory_info([], 8 * 1024**3)
    (8589934592, 'given')
    """
    if isinstance(override, str):
        # What JAX can allocate on that device, as this environment sets it.
        return usable_memory(device_profile(override))[0], MEMORY_GIVEN
    if override is not None:
        return device_memory_bytes(override), MEMORY_GIVEN
    for name, unit in ((DEVICE_MEMORY_ENV, GIB), (DEVICE_MEMORY_GB_ENV, GB)):
        from_env = os.environ.get(name)
        if from_env:
            return _from_environment(name, from_env, unit), MEMORY_ENV
    limits = []
    for device in devices:
        try:
            # Only this process's devices can report (multi-host meshes).
            if device not in device.client.local_devices():
                continue
            stats = device.memory_stats()
        except Exception:  # backends without memory statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(stats["bytes_limit"])
    if limits:
        return min(limits), MEMORY_REPORTED
    return DEFAULT_DEVICE_MEMORY_BYTES, MEMORY_ASSUMED


def _from_environment(name: str, text: str, unit: int) -> int:
    units = "GiB" if unit == GIB else "GB (10^9 bytes)"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0 or value * unit > 2**50:
        raise MeshError(
            f"${name} must be a number of {units} above 0 and at most a "
            f"PiB, e.g. 16. Received: {name}={text!r}"
        )
    return int(value * unit)
