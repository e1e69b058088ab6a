"""Devices to compile for: a named accelerator's, with no accelerator here.

`compile_devices("v5e", 8)` gives eight compile-only "TPU v5 lite" devices
from the TPU compiler of libtpu (`jax.experimental.topologies`);
`compile_devices("t4", 2)` two compile-only T4s from XLA's GPU compiler in
the JAX CUDA plugin, told what a T4 is by a target config shipped with the
package (`gpu_targets/t4.txtpb`). Nothing is allocated on them: they take
`jit(...).lower(...).compile()` and nothing else. When this machine's own
devices are the target (a real T4), those are used instead.

The compilers are optional extras: `keras-hub-autodist[tpu-compile]`
(libtpu) and `keras-hub-autodist[gpu-compile]` (jax-cuda12-plugin and
jax-cuda12-pjrt, no GPU or CUDA toolkit needed), each at the version of
the installed jax.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import itertools
import math
import os

from keras_hub_autodist.errors import CompilerMissingError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.device_profiles import look_up
from keras_hub_autodist.quiet import native_stderr_filtered

TPU_EXTRA = "tpu-compile"
GPU_EXTRA = "gpu-compile"
# The TPU compiler is loaded by every process that asks for a topology;
# libtpu otherwise refuses a second process on the machine (its lockfile),
# though a compile-only client holds no chip.
_LIBTPU_SHARED = "ALLOW_MULTIPLE_LIBTPU_LOAD"


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """How to compile for one named device.

    Args:
        platform: `"tpu"` or `"gpu"`.
        generation: the TPU generation of a topology name (`"v5e"` in
            `"v5e:2x4"`), or the GPU target config's file name.
        kind_words: words of the `device_kind` JAX gives such a device
            (`"T4"` in `"Tesla T4"`), to recognize it among local devices.
        dimensions: 2 or 3, the axes of a TPU topology's chip grid.
    """

    platform: str
    generation: str
    kind_words: tuple[str, ...]
    dimensions: int = 2


# `--device` name -> the compiler's target.
TARGETS = {
    "t4": TargetSpec("gpu", "t4", ("T4",)),
    "l4": TargetSpec("gpu", "l4", ("L4",)),
    "a100-40": TargetSpec("gpu", "a100-40", ("A100", "40GB")),
    "a100-80": TargetSpec("gpu", "a100-80", ("A100", "80GB")),
    "h100": TargetSpec("gpu", "h100", ("H100",)),
    "h200": TargetSpec("gpu", "h200", ("H200",)),
    "v3-8": TargetSpec("tpu", "v3", ("TPU v3",)),
    "v4": TargetSpec("tpu", "v4", ("TPU v4",), dimensions=3),
    "v5e": TargetSpec("tpu", "v5e", ("TPU v5 lite",)),
    "v5p": TargetSpec("tpu", "v5p", ("TPU v5",), dimensions=3),
    "v6e": TargetSpec("tpu", "v6e", ("TPU v6 lite",)),
}
# Chip grids tried for a TPU target, smallest first, until one has the
# mesh's number of devices (a v3 chip is two devices, a v5e chip one).
_GRID_SIDES = (1, 2, 4, 8, 16)
# A host of these TPUs holds at most 2x2x1 chips; a smaller grid is one host.
_HOST_CHIPS = (2, 2, 1)


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """The devices a step is compiled for.

    Args:
        name: the `--device` name, or `""` for this machine's devices.
        platform: `"cpu"`, `"gpu"` or `"tpu"`.
        device_kind: what JAX calls one device (`"TPU v5 lite"`).
        devices: the JAX devices, as many as the mesh has.
        compile_only: True when they are a compiler's stand-ins, not this
            machine's devices.
    """

    name: str
    platform: str
    device_kind: str
    devices: tuple
    compile_only: bool

    def describe(self) -> dict:
        """`{"platform", "device_kind", "devices"}`, as the CLI prints it."""
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "devices": len(self.devices),
        }


def target_spec(name: str) -> TargetSpec:
    """The compiler's target for a `--device` name.

    Raises:
        PlanError: for a name no compiler target is known for.

    Example:
    >>> target_spec("V5E").platform
    'tpu'
    """
    return look_up(
        TARGETS,
        name,
        "No compiler target for device {name!r}: name one of {known}. "
        "Received: device={name!r}",
    )


def local_target(count: int | None = None) -> CompileTarget:
    """This machine's first `count` devices (all by default)."""
    import jax

    devices = tuple(jax.devices()[:count] if count else jax.devices())
    return CompileTarget(
        "", devices[0].platform, devices[0].device_kind, devices, False
    )


def compile_target(name: str, count: int) -> CompileTarget:
    """`count` devices of the named kind to compile for: this machine's when
    it has that many of them, else the compiler's compile-only ones.

    Args:
        name: a `--device` name of `TARGETS` (`"t4"`, `"v5e"`, `"h200"`).
        count: the mesh's number of devices.

    Raises:
        CompilerMissingError: when the target's compiler isn't installed.
        PlanError: when the target has no topology of `count` devices.

    Example:
    ```python
    target = compile_target("v5e", 8)   # a v5e-8, on any machine
    target.device_kind                  # 'TPU v5 lite'
    ```
    """
    spec = target_spec(name)
    key = name.strip().lower()
    local = _local_devices_of(spec, count)
    if local is not None:
        return CompileTarget(key, spec.platform, local[0].device_kind, local, False)
    if spec.platform == "tpu":
        devices = _tpu_devices(spec.generation, spec.dimensions, count)
    else:
        devices = _gpu_devices(spec.generation, count)
    return CompileTarget(key, spec.platform, devices[0].device_kind, devices, True)


def _local_devices_of(spec: TargetSpec, count: int):
    """This machine's devices when they are `count` or more of the target's
    kind; None otherwise (JAX is not asked about accelerators it can't see:
    with `JAX_PLATFORMS=cpu` only the CPU answers)."""
    import jax

    devices = jax.devices()
    if len(devices) < count or devices[0].platform != spec.platform:
        return None
    kind = devices[0].device_kind
    if not all(word in kind for word in spec.kind_words):
        return None
    return tuple(devices[:count])


def _installed(module: str) -> bool:
    """Whether `module` can be imported; a dotted name whose parent package
    is missing is not (where `find_spec` raises instead of saying None)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _require(module: str, extra: str, platform: str) -> None:
    if not _installed(module):
        raise CompilerMissingError(
            f"Compiling for a {platform.upper()} on this machine needs the "
            f"{platform.upper()} compiler, which is not installed: "
            f"`pip install keras-hub-autodist[{extra}]` (it installs "
            f"{_EXTRA_PACKAGES[extra]} at your jax's version). Received: no "
            f"module {module!r}"
        )


_EXTRA_PACKAGES = {
    TPU_EXTRA: "libtpu, as `jax[tpu]` pins it",
    GPU_EXTRA: "jax-cuda12-plugin and jax-cuda12-pjrt",
}


def _tpu_devices(generation: str, dimensions: int, count: int) -> tuple:
    _require("libtpu", TPU_EXTRA, "tpu")
    os.environ.setdefault(_LIBTPU_SHARED, "1")
    tried = []
    for grid in _grids(dimensions):
        if math.prod(grid) > count:
            # A chip is one or two devices: no larger grid has fewer.
            break
        devices = _tpu_topology(generation, grid)
        tried.append(f"{'x'.join(map(str, grid))}: {len(devices)}")
        if len(devices) == count:
            return devices
    raise PlanError(
        f"No {generation} TPU slice has {count} devices (the chip grids "
        f"tried have {'; '.join(tried)}); make the mesh's device count one of "
        f"those. Received: {count} devices"
    )


def _grids(dimensions: int):
    """TPU chip grids, fewest chips first (`(2, 2)`, `(2, 4)`...)."""
    grids = {
        tuple(sorted(sides))
        for sides in itertools.product(_GRID_SIDES, repeat=dimensions)
    }
    return sorted(grids, key=lambda grid: (math.prod(grid), grid))


@functools.cache
def _tpu_topology(generation: str, grid: tuple) -> tuple:
    from jax.experimental import topologies

    host = [min(side, most) for side, most in zip(grid, _HOST_CHIPS)]
    host += [1] * (3 - len(host))
    name = f"{generation}:{'x'.join(map(str, grid))}"
    options = {} if host == list(_HOST_CHIPS) else {"chips_per_host_bounds": host}
    try:
        # libtpu's start-up notices of a machine that is not a TPU VM.
        with native_stderr_filtered():
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=name, **options
            )
    except Exception as error:  # the TPU compiler's own refusal
        raise PlanError(
            f"The TPU compiler has no topology {name}: "
            f"{str(error).splitlines()[0]}. Received: {name}"
        ) from error
    return tuple(topology.devices)


def gpu_target_config(name: str) -> str:
    """The `GpuTargetConfigProto` text of a GPU target (package data).

    Example:
    >>> "core_count: 40" in gpu_target_config("t4")
    True
    """
    folder = importlib.resources.files("keras_hub_autodist.fitting") / "gpu_targets"
    return (folder / f"{name}.txtpb").read_text()


@functools.cache
def _gpu_devices(name: str, count: int) -> tuple:
    _require("jax_plugins.xla_cuda12", GPU_EXTRA, "gpu")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        name,
        "cuda",
        target_config=gpu_target_config(name),
        topology=f"1x1x{count}",
    )
    return tuple(topology.devices)


__all__ = [
    "TARGETS",
    "CompileTarget",
    "TargetSpec",
    "compile_target",
    "gpu_target_config",
    "local_target",
    "target_spec",
]
