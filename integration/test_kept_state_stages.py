"""An error from each stage of a `fit` loop (the data, a step, a callback)
after some steps keeps the state of the last finished step
(tests/test_kept_state.py holds the quick cases)."""

import pytest
from test_kept_state import assert_kept_after_error
from test_kept_state import preset  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["data", "step", "callback"])
def test_an_error_after_two_steps_keeps_the_second(preset, tmp_path, stage):  # noqa: F811
    assert_kept_after_error(preset, tmp_path, stage, finished=2)
