"""The equivalence matrices' cases and CI's choice of them
(tests/matrices.py): which cases are marked, that each listed file exists
and keeps a fast case, and that a changed module, test or helper brings
its matrices back into CI."""

import doctest

import matrices
import pytest


def test_the_doctests_of_the_selection_pass():
    assert doctest.testmod(matrices).failed == 0


def test_every_matrix_file_exists_and_partly_matrix_files_keep_their_fast_ids():
    for test_file in matrices.matrix_files():
        assert (matrices.ROOT / test_file).exists(), test_file
    source = (matrices.ROOT / "tests" / "test_every_mesh_attention.py").read_text()
    for case in matrices.PARTLY_MATRIX["tests/test_every_mesh_attention.py"]:
        assert case in source


def test_a_listed_fast_id_stays_in_the_fast_tier_and_the_rest_are_matrix():
    nodeids = [
        "tests/test_every_mesh_attention.py::test_each[gemma3-splash-one-device]",
        "tests/test_every_mesh_attention.py::test_each[llama3-splash-one-device]",
        "tests/test_every_mesh_attention.py::test_unparametrized",
    ]
    assert matrices.matrix_nodeids(nodeids) == {nodeids[0]}


def test_each_matrix_file_checks_the_modules_tests_readme_maps_to_it():
    checked = matrices.checked_files("integration/test_context_parallel_matrix.py")
    assert "keras_hub_autodist/attention/context_attention.py" in checked
    assert "tests/tiny_presets.py" in checked


@pytest.mark.parametrize(
    "changed",
    [
        "keras_hub_autodist/attention/context_attention.py",
        "integration/test_context_parallel_matrix.py",
        "tests/tiny_presets.py",
    ],
)
def test_a_change_to_what_a_matrix_checks_brings_it_back(changed):
    record = {"digests": matrices.current_digests()}
    assert matrices.changed_matrix_files(record) == []
    record["digests"][changed] = "an older digest"
    files = matrices.changed_matrix_files(record)
    assert "integration/test_context_parallel_matrix.py" in files
    if changed != "tests/tiny_presets.py":
        assert "integration/test_loading_matrix.py" not in files


def test_without_a_record_every_matrix_file_runs():
    assert matrices.changed_matrix_files(None) == matrices.matrix_files()
