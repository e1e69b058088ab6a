"""The loading bench's steering check, computed from its rows: what the more
layers add to the load, against what they add to each floor's read."""

from bench import report_loading
from bench.loading import MARGINAL_FORMAT
from bench.loading import MARGINAL_LAYERS
from bench.loading import MARGINAL_VARIANTS

FEWER, MORE = MARGINAL_LAYERS


def rows(load, plain, keeping):
    """Rows of the steering check: seconds by variant, fewer layers first."""
    return [
        {"format": MARGINAL_FORMAT, "layers": layers, "variant": variant, "load_s": s}
        for variant, seconds in zip(MARGINAL_VARIANTS, (load, plain, keeping))
        for layers, s in zip(MARGINAL_LAYERS, seconds)
    ] + [{"format": "keras bfloat16", "variant": MARGINAL_VARIANTS[0], "load_s": 9.0}]


def verdicts(checks):
    return [(met, value) for _, met, value in checks]


def test_each_floor_divides_what_the_more_layers_add():
    """Ratios exactly at their bounds (binary fractions) are met."""
    lines, checks = report_loading._marginal(rows((2.0, 3.5), (0.5, 1.0), (0.5, 1.5)))
    assert verdicts(checks) == [(True, "3.00x"), (True, "1.50x")]
    assert f"{MORE - FEWER} more layers <= 3 x their file read (" in checks[0][0]
    assert "<= 1.5 x their file read keeping every tensor (" in checks[1][0]
    assert f"| {MORE - FEWER} more | 1.50 | 0.50 | 1.00 |" in lines
    assert f"| {FEWER} | 2.00 | 0.50 | 0.50 |" in lines


def test_a_load_above_a_bound_is_not_met():
    _, checks = report_loading._marginal(rows((2.0, 4.0), (0.5, 1.1), (0.9, 2.0)))
    assert verdicts(checks) == [(False, "3.33x"), (False, "1.82x")]


def test_a_read_that_adds_nothing_is_not_met():
    """Noise can make the larger file read as fast as the smaller one: the
    check has no ratio and is not met, never a division error or a pass."""
    _, checks = report_loading._marginal(rows((2.0, 2.1), (0.6, 0.6), (0.9, 2.0)))
    assert verdicts(checks)[0] == (False, "their read took no time")


def test_without_its_rows_the_section_has_no_steering_check():
    assert report_loading._marginal(rows((2.0, 3.8), (0.5, 1.1), (0.9, 2.1))[-1:]) == (
        [],
        [],
    )
