"""Run a function when a module is first imported: the package's one
`sys.meta_path` finder.

The package uses it to switch the plugin on the moment `keras_hub` is
imported, and so does the startup hook installed with the package (which
loads this file by path, standard library only, without importing the
package). Callbacks run once each, in the order given, after the module
has executed; a callback that raises never breaks the user's import.
`while_importing` runs a module's first import inside a context manager
(the package filters TensorFlow's start-up notices that way).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

# Module name -> {callback name: callback}, waiting for the first import.
_waiting: dict[str, dict[str, Callable[[], None]]] = {}
# Module name -> a factory of the context its first import runs in.
_around: dict[str, Callable[[], AbstractContextManager]] = {}


def when_imported(module: str, name: str, callback: Callable[[], None]) -> None:
    """Call `callback()` now if `module` is imported, else right after its
    first import. A second callback under the same `name` replaces the first.

    Example:
    ```python
    when_imported("keras_hub", "activate", activate)
    ```
    """
    if module in sys.modules:
        _run(module, {name: callback})
        return
    _waiting.setdefault(module, {})[name] = callback
    _install_finder()


def while_importing(module: str, context: Callable[[], AbstractContextManager]) -> None:
    """Run the first import of `module` inside `context()`, unless it is
    imported already. A second context for the same module replaces the
    first.

    Example:
    ```python
    while_importing("tensorflow", quiet.native_stderr_filtered)
    ```
    """
    if module in sys.modules:
        return
    _around[module] = context
    _install_finder()


def _install_finder() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _run(module: str, callbacks: dict[str, Callable[[], None]]) -> None:
    for name, callback in callbacks.items():
        try:
            callback()
        except Exception as error:  # never break the user's import
            # Standard library only: the startup hook loads this module
            # without importing the package (`errors.warn` would).
            warnings.warn(
                f"keras-hub-autodist: {name} failed after `import {module}`: "
                f"{type(error).__name__}: {error}",
                stacklevel=3,
            )


class _Loader:
    """Runs the module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader, module: str):
        self._loader = loader
        self._module = module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with _around.pop(self._module, contextlib.nullcontext)():
            self._loader.exec_module(module)
        _run(self._module, _waiting.pop(self._module, {}))

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """Finds nothing itself: wraps the loader the other finders give for a
    module that callbacks wait for."""

    def find_spec(self, name, path=None, target=None):
        if name not in _waiting and name not in _around:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None
