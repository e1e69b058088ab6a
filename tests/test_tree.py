"""The package's tree is its data path: each stage is a folder, a module
imports only from its own stage, the stages before it and the edges, and no
modules import each other in a loop. Imports inside functions and under
`TYPE_CHECKING` count too. tests/README.md names every module."""

import ast
import functools
import importlib
import pathlib
import re
import sys
import warnings

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_hub_autodist"
TESTS_README = pathlib.Path(__file__).resolve().parent / "README.md"

# The stages in data-path order; a module may import from its own row and
# the rows above it. Top-level modules not named here are entries.
STAGES = (
    (
        "errors",
        "environment",
        "compat",
        "on_import",
        "devices",
        "tiny_tokenizers",
        "words",
        "quiet",
    ),
    ("reading",),
    ("architectures",),
    ("planning",),
    ("attention",),
    ("loss",),
    ("fitting",),
    ("searching",),
    ("loading",),
    ("saving",),
    ("training",),
)
ENTRY = len(STAGES)


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(("keras_hub_autodist",) + parts)] = path
    return names


def stage_of(module: str) -> int:
    parts = module.split(".")[1:]
    first = parts[0] if parts else "__init__"
    for rank, names in enumerate(STAGES):
        if first in names:
            return rank
    return ENTRY


def imports_of(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates = [node.module] + [
                f"{node.module}.{alias.name}" for alias in node.names
            ]
        else:
            continue
        found |= {name for name in candidates if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    known = set(names) - {"keras_hub_autodist"}
    return {
        module: imports_of(path, known) - {module} for module, path in names.items()
    }


def test_no_module_imports_from_a_later_stage():
    backward = [
        f"{module} ({stage_of(module)}) imports {target} ({stage_of(target)})"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if stage_of(target) > stage_of(module)
    ]
    assert backward == []


def test_no_modules_import_each_other_in_a_loop():
    graph = import_graph()
    state, loops = {}, []

    def visit(module, trail):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                loops.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert loops == []


def test_the_tests_map_names_every_module():
    text = TESTS_README.read_text()
    listed = set(re.findall(r"`(keras_hub_autodist/[\w/]+\.py)`", text))
    modules = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert sorted(modules - listed) == [], "add these modules to tests/README.md"
    assert sorted(listed - modules) == [], "tests/README.md names modules that are gone"
    tests = set(re.findall(r"`((?:tests|integration)/test_\w+\.py)`", text))
    root = PACKAGE.parent
    assert sorted(t for t in tests if not (root / t).exists()) == []


def _moved_modules():
    from keras_hub_autodist import moved_modules

    return sorted(moved_modules.MOVED_MODULES.items())


def _import_statement(former):
    """`import a.b.c`, which warns by itself; then the module it bound."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = {}
        exec(f"import {former}", {}, found)
    assert [w.category for w in caught] == [DeprecationWarning], former
    warnings.warn(caught[0].message, stacklevel=2)
    top, *names = former.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return functools.reduce(getattr, names, found[top])


def _from_import(former):
    package, _, name = former.rpartition(".")
    found = {}
    exec(f"from {package} import {name} as found", {}, found)
    return found["found"]


def _attribute(former):
    package, _, name = former.rpartition(".")
    return getattr(sys.modules[package], name)


WAYS = {
    "import a.b.c": _import_statement,
    "from a.b import c": _from_import,
    "a.b.c": _attribute,
    "import_module": importlib.import_module,
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("former, name", _moved_modules())
def test_a_moved_module_imports_by_its_former_name_with_a_warning(former, name, way):
    """Each way, each time (not only a process's first), warns and gives the
    module itself, which keeps its own spec."""
    module = importlib.import_module(name)
    for _ in range(2):
        with pytest.warns(DeprecationWarning, match=re.escape(f"use `{name}`")):
            assert WAYS[way](former) is module
    assert module.__spec__.name == name
    assert former not in sys.modules


def test_the_top_level_former_path_of_step_memory_is_listed():
    from keras_hub_autodist import moved_modules

    assert (
        moved_modules.MOVED_MODULES["keras_hub_autodist.step_memory"]
        == "keras_hub_autodist.fitting.step_memory"
    )


@pytest.mark.parametrize(
    "former, name",
    [
        (
            "keras_hub_autodist.planning.context_attention",
            "keras_hub_autodist.attention.context_attention",
        ),
        (
            "keras_hub_autodist.planning.attention_blocks",
            "keras_hub_autodist.attention.attention_blocks",
        ),
        ("keras_hub_autodist.fitting.search", "keras_hub_autodist.searching.search"),
        (
            "keras_hub_autodist.fitting.search_cache",
            "keras_hub_autodist.searching.cache",
        ),
        (
            "keras_hub_autodist.fitting.auto_search",
            "keras_hub_autodist.searching.auto_mesh",
        ),
    ],
)
def test_the_attention_and_search_modules_keep_their_former_paths(former, name):
    """The former paths of the attention kernels (in `planning`) and of the
    layout search (in `fitting`) are listed, each the module itself."""
    from keras_hub_autodist import moved_modules

    assert moved_modules.MOVED_MODULES[former] == name
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module(former)
    assert module is importlib.import_module(name)


def test_the_former_attention_blocks_path_keeps_the_strategies():
    with pytest.warns(DeprecationWarning):
        from keras_hub_autodist.planning.attention_blocks import (
            CONTEXT_PARALLEL_STRATEGIES,
        )
    from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES as now

    assert CONTEXT_PARALLEL_STRATEGIES is now
