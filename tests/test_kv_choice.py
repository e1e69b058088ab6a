"""`policy.choose_kv_layout`: the key/value layouts are alternatives compared
by communication cost, subject to the device memory and the per-device
parameter target."""

import re

import pytest

from keras_hub_autodist.fitting import policy
from keras_hub_autodist.planning import layouts

GIB = 1024**3
REPLICATE, HEAD_DIM = policy.KV_LAYOUTS


def choose(replicate, head_dim, capacity=16 * GIB, target=1.10):
    """Each argument: (training GiB per device, ideal ratio)."""
    candidates = [
        policy.KVCandidate(HEAD_DIM, int(head_dim[0] * GIB), head_dim[1]),
        policy.KVCandidate(REPLICATE, int(replicate[0] * GIB), replicate[1]),
    ]
    layout, reason = policy.choose_kv_layout(
        candidates, capacity=capacity, target=target, strategy="tp", axis="model"
    )
    return layout.kv_fallback, reason


def test_the_cheapest_communication_is_listed_first():
    assert [k.collective_rank for k in policy.KV_LAYOUTS] == [0, 1]
    assert REPLICATE.kv_fallback == "replicate"


def test_the_policy_compares_the_layouts_planning_costs():
    assert tuple(k.kv_fallback for k in policy.KV_LAYOUTS) == layouts.KV_FALLBACKS


@pytest.mark.parametrize(
    "replicate, head_dim, chosen, reason",
    [
        # Both acceptable: the one moving fewer bytes, whatever the order given.
        ((2, 1.02), (1, 1.0), "replicate", r"replicated over 'model': fewer"),
        # Replicating breaks the memory: sharding fits.
        ((20, 1.02), (12, 1.0), "head_dim", r"would need 20\.00 GiB > 16\.00"),
        # Replicating breaks the parameter target only.
        ((2, 1.30), (1, 1.0), "head_dim", r"would hold 1\.300x the ideal.*1\.10x"),
        # Neither acceptable, both fit: the cheaper.
        ((2, 1.30), (1, 1.2), "replicate", r"fit in 16\.00 GiB"),
        # Sharding fits but breaks the target; replicating doesn't fit: memory first.
        ((20, 1.02), (12, 1.2), "head_dim", r"would need 20\.00 GiB"),
        # Neither fits: the cheaper, and the reason says so.
        ((40, 1.02), (30, 1.0), "replicate", r"neither K/V layout fits 16\.00 GiB"),
    ],
)
def test_choice_and_reason(replicate, head_dim, chosen, reason):
    got, text = choose(replicate, head_dim)
    assert got == chosen
    assert re.search(reason, text), text
