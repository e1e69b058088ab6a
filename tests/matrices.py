"""Which test cases are the equivalence matrices, and which of them CI runs.

The matrices check the package against one device case by case: every
family, mesh, kernel and strategy. Their cases are marked `matrix` as
they are collected (`mark_matrix_cases`, called by conftest.py):

- every case of a file named `*_matrix.py` (`integration/`);
- in the files of `PARTLY_MATRIX`, every case of a parametrized test but
  those kept in the fast tier: the ids listed there, else its first case.

The fast tier (`nox -s tests`, `nox -s integration`) leaves them out;
`nox -s matrices` runs them all and, where every one passed, records the
digest of each file they check in `RECORD` (`python tests/matrices.py
--record`, which that session runs). CI (`.ci/run`) then runs the matrix
cases of the test files whose checked files changed since that record
(`python tests/matrices.py --changed`): a test file, the helpers every
test imports, and the modules tests/README.md maps to that file.

    python tests/matrices.py --changed   # the test files CI runs, a line each
    python tests/matrices.py --record    # after a full `nox -s matrices`
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / ".ci" / "matrices-passed.json"
TESTS_README = ROOT / "tests" / "README.md"
MARKER = "matrix"
# Files every matrix case reads besides its own: a change to one runs them
# all.
HELPERS = (
    "conftest.py",
    "tests/tiny_presets.py",
    "tests/equivalence.py",
    "tests/hf_checkpoints.py",
    "tests/real_presets.py",
)
WHOLLY_MATRIX = "integration/*_matrix.py"
# test file -> ids of the parametrized cases each of its tests keeps in the
# fast tier (a test whose ids are none of these keeps its first case).
PARTLY_MATRIX = {
    "tests/test_context_attention.py": (),
    "tests/test_every_mesh_attention.py": (
        "llama3-splash-one-device",
        "phi3-splash-batch2-model4",
        "gemma2-splash-batch4-model2",
        "over",
    ),
    "tests/test_from_preset.py": (),
    "tests/test_chunked_loss.py": (),
    "tests/test_cudnn_attention.py": (),
    "tests/test_ring_attention.py": (),
    "tests/test_context_parallel.py": (),
}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _case_id(nodeid: str) -> str | None:
    """`a-b` of `file::test[a-b]`; None for a test that isn't parametrized."""
    match = re.search(r"\[(.*)\]$", nodeid)
    return match.group(1) if match else None


def matrix_nodeids(nodeids: list[str]) -> set[str]:
    """The matrix cases among `nodeids`, collected in order.

    Example:
    >>> for nodeid in sorted(matrix_nodeids([
    ...     "tests/test_ring_attention.py::test_x[a]",
    ...     "tests/test_ring_attention.py::test_x[b]",
    ...     "tests/test_plan.py::test_y[a]",
    ...     "integration/test_loading_matrix.py::test_z",
    ... ])):
    ...     print(nodeid)
    integration/test_loading_matrix.py::test_z
    tests/test_ring_attention.py::test_x[b]
    """
    marked, cases = set(), {}
    for nodeid in nodeids:
        path = _file_of(nodeid)
        if fnmatch.fnmatch(path, WHOLLY_MATRIX):
            marked.add(nodeid)
        elif path in PARTLY_MATRIX and _case_id(nodeid) is not None:
            test = nodeid[: nodeid.rindex("[")]
            cases.setdefault(test, []).append(nodeid)
    for test, nodeids_of_test in cases.items():
        kept = PARTLY_MATRIX[_file_of(test)]
        fast = [n for n in nodeids_of_test if _case_id(n) in kept]
        fast = fast or nodeids_of_test[:1]
        marked.update(n for n in nodeids_of_test if n not in fast)
    return marked


def mark_matrix_cases(items) -> None:
    """Add the `matrix` marker to the matrix cases among pytest's `items`."""
    import pytest

    marked = matrix_nodeids([item.nodeid for item in items])
    for item in items:
        if item.nodeid in marked:
            item.add_marker(pytest.mark.matrix)


def matrix_files() -> list[str]:
    """Every test file that holds matrix cases."""
    wholly = sorted(str(path.relative_to(ROOT)) for path in ROOT.glob(WHOLLY_MATRIX))
    return wholly + sorted(PARTLY_MATRIX)


def checked_files(test_file: str) -> set[str]:
    """What a matrix file's cases read: the file, `HELPERS`, and the
    modules tests/README.md maps to it."""
    files = {test_file, *HELPERS}
    for line in TESTS_README.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 2 and f"`{test_file}`" in cells[2]:
            files.update(re.findall(r"`(keras_hub_autodist/[^`]+\.py)`", cells[1]))
    return files


def digest(path: str) -> str:
    """The sha256 of a file of the checkout ("missing" where it is gone)."""
    full = ROOT / path
    if not full.exists():
        return "missing"
    return hashlib.sha256(full.read_bytes()).hexdigest()


def current_digests() -> dict[str, str]:
    """Every checked file of every matrix file, with its digest now."""
    paths = set().union(*(checked_files(f) for f in matrix_files()))
    return {path: digest(path) for path in sorted(paths)}


def changed_matrix_files(record: dict | None) -> list[str]:
    """The matrix files whose checked files differ from `record`'s digests
    (all of them without a record)."""
    if record is None:
        return matrix_files()
    passed = record.get("digests", {})
    return [
        test_file
        for test_file in matrix_files()
        if any(passed.get(p) != digest(p) for p in sorted(checked_files(test_file)))
    ]


def read_record() -> dict | None:
    return json.loads(RECORD.read_text()) if RECORD.exists() else None


def write_record() -> None:
    """Record the digests the matrices passed on."""
    record = {
        "what": "the files every matrix case checked when `nox -s matrices` "
        "last passed in full (tests/matrices.py)",
        "digests": current_digests(),
    }
    RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--changed", action="store_true")
    group.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)
    if args.record:
        write_record()
        print(f"recorded {RECORD.relative_to(ROOT)}")
        return 0
    for test_file in changed_matrix_files(read_record()):
        print(test_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
