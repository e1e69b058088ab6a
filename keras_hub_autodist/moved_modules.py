"""Documented modules that moved into another stage's folder, importable by
their former names for one release, with a `DeprecationWarning`.

The memory answers moved from `keras_hub_autodist.planning` (and
`keras_hub_autodist.step_memory`) to `keras_hub_autodist.fitting`, and the
attention kernels from `keras_hub_autodist.planning` to
`keras_hub_autodist.attention`, and the layout search from
`keras_hub_autodist.fitting` to `keras_hub_autodist.searching`. Each
former name (`MOVED_MODULES`) gives the module it now is (the same object),
with a `DeprecationWarning` naming the new one, in every way a module is
reached:

- `import keras_hub_autodist.planning.step_memory` and
  `importlib.import_module(...)`: an import hook (`MovedModuleFinder`);
- `from keras_hub_autodist.planning import step_memory` and
  `keras_hub_autodist.planning.step_memory`: the attribute of the package,
  served by the package's class (`PackageWithMovedModules`).

A former name is never kept: not in `sys.modules` nor as an attribute of
its package, so that each import or access warns, not only a process's
first. The layout stage itself imports none of the moved modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

_MOVED_TO_FITTING = (
    "compile_targets",
    "compiled_analysis",
    "compiled_answer",
    "compiled_step",
    "device_memory",
    "device_profiles",
    "layout_plan",
    "memory",
    "memory_factors",
    "planner",
    "plot",
    "policy",
    "report",
    "step_memory",
)

_MOVED_TO_ATTENTION = (
    "attention_blocks",
    "blockwise_attention",
    "causal_balance",
    "context_attention",
    "ring_attention",
    "splash_attention",
)

# The layout search's modules, by their names in `fitting` and now.
_MOVED_TO_SEARCHING = {
    "auto_search": "auto_mesh",
    "search": "search",
    "search_cache": "cache",
    "search_candidates": "candidates",
    "search_inputs": "inputs",
    "search_report": "report",
    "step_cost": "step_cost",
}

# Former module name -> the module's name now.
MOVED_MODULES = {
    "keras_hub_autodist.step_memory": "keras_hub_autodist.fitting.step_memory",
    **{
        f"keras_hub_autodist.planning.{name}": f"keras_hub_autodist.fitting.{name}"
        for name in _MOVED_TO_FITTING
    },
    **{
        f"keras_hub_autodist.planning.{name}": f"keras_hub_autodist.attention.{name}"
        for name in _MOVED_TO_ATTENTION
    },
    **{
        f"keras_hub_autodist.fitting.{name}": f"keras_hub_autodist.searching.{now}"
        for name, now in _MOVED_TO_SEARCHING.items()
    },
}

# The packages that held a moved module.
PACKAGES = sorted({former.rpartition(".")[0] for former in MOVED_MODULES})


def moved_module(former: str) -> types.ModuleType:
    """The module a former name (a key of `MOVED_MODULES`) now is, with a
    `DeprecationWarning` that names it."""
    from keras_hub_autodist.errors import warn

    moved = MOVED_MODULES[former]
    warn(f"`{former}` is deprecated; use `{moved}`.", DeprecationWarning)
    return importlib.import_module(moved)


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a former module name (`MOVED_MODULES`) as the module it now
    is, with a `DeprecationWarning` naming the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = moved_module(spec.name)
        # The import system gives the module the former name's spec; the
        # module keeps its own (held by that spec, put back by `exec_module`).
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        """Nothing to run (the module is the one already imported); put
        back the module's own spec."""
        module.__spec__ = module.__spec__.loader_state


class PackageWithMovedModules(types.ModuleType):
    """A package whose moved modules are attributes served by their former
    names, each access with its warning, and never stored (the import system
    stores an imported submodule on its package: here that also drops the
    former name from `sys.modules`, so the next import warns again)."""

    def __getattr__(self, name: str):
        former = f"{self.__name__}.{name}"
        if former in MOVED_MODULES:
            return moved_module(former)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        former = f"{self.__name__}.{name}"
        if former in MOVED_MODULES:
            sys.modules.pop(former, None)
            return
        super().__setattr__(name, value)


def install() -> None:
    """Serve the former names (once per process): the import hook, and the
    class of each package that held a moved module."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
    for package in PACKAGES:
        module = importlib.import_module(package)
        if not isinstance(module, PackageWithMovedModules):
            module.__class__ = PackageWithMovedModules
