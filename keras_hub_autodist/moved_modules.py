"""Documented modules that moved into another stage's folder, importable by
their former names for one release, with a `DeprecationWarning`.

The memory answers moved from `keras_hub_autodist.planning` to
`keras_hub_autodist.fitting`; `import keras_hub_autodist.planning.step_memory`
and `from keras_hub_autodist.planning import step_memory` still give the
module, now `keras_hub_autodist.fitting.step_memory` (the same object). The
layout stage itself imports none of them: the former names are served by an
import hook the package installs, not by modules left in `planning/`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# Former module name -> the module's name now.
MOVED_MODULES = {
    f"keras_hub_autodist.planning.{name}": f"keras_hub_autodist.fitting.{name}"
    for name in (
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
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a former module name (`MOVED_MODULES`) as the module it now
    is, with a `DeprecationWarning` naming the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        from keras_hub_autodist.errors import warn

        moved = MOVED_MODULES[spec.name]
        warn(
            f"`{spec.name}` is deprecated; use `{moved}`.",
            DeprecationWarning,
        )
        return importlib.import_module(moved)

    def exec_module(self, module):
        """Nothing to run: the module is the one already imported."""


def install() -> None:
    """Serve the former names (once per process)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
