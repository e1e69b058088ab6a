"""The package's tree is its data path: each stage is a folder, a module
imports only from its own stage, the stages before it and the edges, and no
modules import each other in a loop. Imports inside functions and under
`TYPE_CHECKING` count too. tests/README.md names every module."""

import ast
import pathlib
import re

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
    ("fitting",),
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


def test_the_moved_modules_import_by_their_former_names_with_a_warning():
    import importlib
    import warnings

    from keras_hub_autodist import moved_modules
    from keras_hub_autodist.fitting import compile_targets
    from keras_hub_autodist.fitting import step_memory

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        former = importlib.import_module("keras_hub_autodist.planning.step_memory")
        from keras_hub_autodist.planning import compile_targets as former_targets
    assert former is step_memory and former_targets is compile_targets
    assert any(
        "keras_hub_autodist.fitting.step_memory" in str(w.message)
        and w.category is DeprecationWarning
        for w in caught
    )
    for former_name, name in moved_modules.MOVED_MODULES.items():
        assert importlib.import_module(former_name) is importlib.import_module(name)
