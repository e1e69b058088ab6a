"""This machine's devices: is there an accelerator, and if not, virtual CPU
devices for JAX (set before JAX starts). Used by the command and the demo;
standard library only until `describe_devices` asks JAX."""

from __future__ import annotations

import os


def has_accelerator() -> bool:
    """Whether a GPU or TPU is visible, checked without starting JAX."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = os.listdir("/dev") if os.path.isdir("/dev") else []
    return any(d.startswith(("nvidia", "accel", "vfio")) for d in devices)


def use_virtual_cpu_devices(count: int = 8) -> None:
    """Give JAX `count` virtual CPU devices; call before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={count}".strip()
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def describe_devices() -> str:
    """The devices JAX runs on, named for what they are.

    Several CPU devices in one process are virtual ones (XLA splits the host
    into `--xla_force_host_platform_device_count` devices).

    Example:
    ```python
    describe_devices()  # '8 virtual CPU devices (no accelerator found)'
    ```
    """
    import jax

    devices = jax.devices()
    count = len(devices)
    plural = "" if count == 1 else "s"
    if devices[0].platform == "cpu":
        virtual = "virtual " if count > 1 else ""
        why = "accelerator present, JAX runs on the CPU"
        if not has_accelerator():
            why = "no accelerator found"
        return f"{count} {virtual}CPU device{plural} ({why})"
    kinds = ", ".join(sorted({device.device_kind for device in devices}))
    return f"{count} {devices[0].platform.upper()} device{plural} ({kinds})"
