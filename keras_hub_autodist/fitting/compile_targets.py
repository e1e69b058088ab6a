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


def attached(name: str, count: int) -> bool:
    """Whether this process alone has `count` devices of the named kind:
    then a step compiled for them can also be run on them. Not in a run of
    several processes: each would time its own runs, and processes that
    chose by different times would run different programs.

    Example:
    >>> attached("h200", 1)  # on a machine without an H200
    False
    """
    import jax

    if jax.process_count() > 1:
        return False
    return _local_devices_of(target_spec(name), count) is not None


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


def compile_mesh(plan, device_mesh=None, device: str | None = None):
    """The mesh a plan's step is compiled for, and what its devices are.

    - `device_mesh` alone: that mesh, as it is.
    - `device` (with or without `device_mesh`): a mesh of `device_mesh`'s
      shape and axis names (else the plan's) over as many of the named
      accelerator's devices (`compile_target`: this machine's when it has
      them, else the compiler's compile-only ones). A `device_mesh` already
      made of such devices of this machine is kept as it is.
    - neither: the plan's shape over the device the plan was made for
      (`plan(..., device_memory="v5e")`), else this machine's first devices.

    Args:
        plan: a `LayoutPlan`.
        device_mesh: a `keras.distribution.DeviceMesh`, or `None`.
        device: a name of `TARGETS`, or `None`.

    Example:
    ```python
    mesh, target = compile_mesh(plan, cpu_mesh, "v5e")
    target.device_kind  # 'TPU v5 lite', the mesh's shape
    ```
    """
    import numpy as np

    from keras_hub_autodist.planning.mesh import build_device_mesh
    from keras_hub_autodist.planning.mesh import require_device_mesh

    if device_mesh is not None:
        device_mesh = require_device_mesh(
            device_mesh,
            "The compiled memory check compiles for real devices: pass a "
            "`keras.distribution.DeviceMesh` as device_mesh=, or none to use "
            "all devices in the planned shape.",
        )
        devices = tuple(np.ravel(device_mesh.backend_mesh.devices))
        shape = dict(zip(device_mesh.axis_names, device_mesh.shape))
        local = devices[0] in set(_all_devices())
        mesh_target = CompileTarget(
            "", devices[0].platform, devices[0].device_kind, devices, not local
        )
        if not device:
            return device_mesh, mesh_target
        target = compile_target(device, len(devices))
        if (
            local
            and not target.compile_only
            and target.device_kind == (mesh_target.device_kind)
        ):
            return device_mesh, dataclasses.replace(mesh_target, name=target.name)
        return build_device_mesh(shape, list(target.devices)), target
    axes = plan.mesh_axes
    device = device or getattr(plan, "device_name", "") or ""
    if device:
        target = compile_target(device, axes.num_devices)
    else:
        _require_local_devices(axes)
        target = local_target(axes.num_devices)
    shape = dict(zip(axes.axis_names, axes.shape))
    return build_device_mesh(shape, list(target.devices)), target


def _require_local_devices(axes) -> None:
    """Refuse, naming the plan's device count, a compile for this machine's
    devices when it has fewer than the plan's mesh."""
    devices = _all_devices()
    if len(devices) < axes.num_devices:
        raise PlanError(
            f"The compiled check compiles for the plan's {axes.num_devices} "
            f"devices ({axes.describe()}), and this machine has "
            f"{len(devices)} {devices[0].platform} devices. Compile for a "
            "named accelerator instead (`device='v5e'`), or plan for at most "
            f"{len(devices)} devices. Received: a plan for {axes.num_devices} "
            f"devices ({axes.describe()})"
        )


def _all_devices():
    import jax

    return jax.devices()


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


_CUDA_PLUGIN = "jax_plugins.xla_cuda12"
# The CUDA plugin checks this machine's CUDA libraries when JAX starts it,
# unless told not to; on a machine without a GPU that check fails and JAX
# leaves the plugin, and with it the GPU compiler, unregistered.
_SKIP_CUDA_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


@functools.cache
def _gpu_devices(name: str, count: int) -> tuple:
    _require(_CUDA_PLUGIN, GPU_EXTRA, "gpu")
    from jax.experimental import topologies

    def topology():
        return topologies.get_topology_desc(
            name,
            "cuda",
            target_config=gpu_target_config(name),
            topology=f"1x1x{count}",
        )

    try:
        return tuple(topology().devices)
    except NotImplementedError:
        # JAX started without the plugin (its CUDA check failed: no GPU
        # here): register it for compiling only, and ask again.
        _register_cuda_compiler()
        return tuple(topology().devices)


def _register_cuda_compiler() -> None:
    """Register the CUDA plugin with JAX without its check of this machine's
    CUDA libraries, which compiling doesn't need; the environment is left
    as it was."""
    import importlib

    plugin = importlib.import_module(_CUDA_PLUGIN)
    saved = os.environ.get(_SKIP_CUDA_CHECK)
    os.environ[_SKIP_CUDA_CHECK] = "1"
    try:
        with native_stderr_filtered():
            plugin.initialize()
    finally:
        if saved is None:
            del os.environ[_SKIP_CUDA_CHECK]
        else:
            os.environ[_SKIP_CUDA_CHECK] = saved


__all__ = [
    "TARGETS",
    "CompileTarget",
    "TargetSpec",
    "compile_target",
    "gpu_target_config",
    "local_target",
    "target_spec",
]
