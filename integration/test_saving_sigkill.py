"""A save killed at random points without `renameat2` or with a read-only
parent still leaves the old or the new preset (tests/test_saving.py runs the
`renameat2` exchange)."""

import pytest
from test_saving import assert_sigkill_leaves_old_or_new

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["two renames", "in place"])
def test_sigkill_at_random_points_leaves_old_or_new(tmp_path, mode):
    assert_sigkill_leaves_old_or_new(tmp_path, mode)
