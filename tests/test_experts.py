"""The `expert` logical axis: expert parallelism, its fallbacks and the
`expert` mesh axis (sharding.py and mesh.py, on weight specs; no model)."""

import keras
import pytest

from keras_hub_autodist import MeshError
from keras_hub_autodist import sharding
from keras_hub_autodist.mesh import resolve_mesh_axes
from keras_hub_autodist.weight import Weight

FIELDS = {
    "vocab": "vocabulary_size",
    "embed": "hidden_dim",
    "heads": "num_query_heads",
    "mlp": "intermediate_dim",
    "expert": "num_experts",
}
QWEN_FIELDS = {**FIELDS, "expert_mlp": "moe_intermediate_dim"}


def experts_in(num_experts, hidden=16, mlp=32):
    """A batched gate/up expert kernel, `(experts, hidden, mlp)`."""
    return Weight(
        "layer_0/moe/experts/gate",
        "layer_0/moe/experts/gate",
        (num_experts, hidden, mlp),
        ("expert", "embed", "mlp"),
    )


def experts_out(num_experts, hidden=16, mlp=32):
    """A batched output expert kernel, `(experts, mlp, hidden)`."""
    return Weight(
        "layer_0/moe/experts/output",
        "layer_0/moe/experts/output",
        (num_experts, mlp, hidden),
        ("expert", "mlp", "embed"),
    )


ROUTER = Weight(
    "layer_0/moe/router/kernel",
    "layer_0/moe/router/kernel",
    (16, 8),
    ("embed", "unsharded"),
)
QUERY = Weight(
    "layer_0/query/kernel",
    "layer_0/query/kernel",
    (16, 4, 4),
    ("embed", "heads", "head_dim"),
)


def assign(weight, mesh, strategy="tp", fields=FIELDS):
    """The spec and the fallbacks' texts."""
    spec, fallbacks = sharding.assign_mesh_axes(
        weight, resolve_mesh_axes(mesh), strategy, fields
    )
    return spec, [str(fallback) for fallback in fallbacks]


@pytest.mark.parametrize("model", [2, 4, 8])
def test_experts_that_divide_the_model_axis_go_over_it(model):
    spec, notes = assign(experts_in(8), {"batch": 1, "model": model})
    assert spec == ("model", None, None) and notes == []
    spec, notes = assign(experts_out(8), {"batch": 1, "model": model})
    # Expert parallelism: each expert's MLP stays whole on its device.
    assert spec == ("model", None, None) and notes == []


def test_experts_that_do_not_divide_split_their_mlp_instead():
    spec, notes = assign(experts_in(6), {"batch": 2, "model": 4})
    assert spec == (None, None, "model")
    assert notes == [
        "num_experts=6 does not divide by model=4: sharded intermediate_dim=32 "
        "over 'model' instead"
    ]
    spec, notes = assign(experts_out(6), {"batch": 2, "model": 4})
    assert spec == (None, "model", None)
    assert notes == [
        "num_experts=6 does not divide by model=4: sharded intermediate_dim=32 "
        "over 'model' instead"
    ]


def test_expert_mlp_field_names_the_expert_intermediate_size():
    spec, notes = assign(
        experts_in(60, 32, 16), {"batch": 1, "model": 8}, fields=QWEN_FIELDS
    )
    assert spec == (None, None, "model")
    assert notes == [
        "num_experts=60 does not divide by model=8: sharded "
        "moe_intermediate_dim=16 over 'model' instead"
    ]


def test_neither_experts_nor_mlp_divide():
    spec, notes = assign(experts_in(6, hidden=16, mlp=30), {"batch": 1, "model": 4})
    assert spec == (None, "model", None)
    assert notes == [
        "num_experts=6 does not divide by model=4: sharded hidden_dim=16 over "
        "'model' instead"
    ]
    spec, notes = assign(experts_in(6, hidden=6, mlp=30), {"batch": 1, "model": 4})
    assert spec == (None, None, None)
    assert notes == [
        "num_experts=6 does not divide by model=4: replicated over 'model'"
    ]


def test_router_is_replicated_over_the_model_axis():
    assert assign(ROUTER, {"batch": 1, "model": 8}) == ((None, None), [])
    # fsdp still shards its hidden dimension over the batch axis.
    assert assign(ROUTER, {"batch": 2, "model": 4}, "fsdp") == (("batch", None), [])
    # ... and never its expert column, even when nothing else is free.
    spec, notes = assign(ROUTER, {"batch": 32, "model": 1}, "fsdp")
    assert spec == (None, None)
    assert "replicated over 'batch'" in notes[0]


# The batch axis takes the first free dimension of `sharding.FSDP_AXIS_PREFERENCE`
# that divides: each expert's `mlp`, else the experts, else `hidden`.
@pytest.mark.parametrize(
    "weight, spec",
    [
        (experts_in(8), ("model", None, "batch")),
        (experts_out(8), ("model", "batch", None)),
        (experts_in(6), ("batch", None, "model")),
    ],
)
def test_fsdp_adds_the_batch_axis_on_a_free_dimension(weight, spec):
    assert assign(weight, {"batch": 2, "model": 4}, "fsdp")[0] == spec


def test_fsdp_falls_back_to_the_expert_dimension():
    # hidden 6 and mlp 10 don't divide by batch=4, the 8 experts do.
    weight = experts_in(8, hidden=6, mlp=10)
    assert assign(weight, {"batch": 4, "model": 1}, "fsdp") == (
        ("batch", None, None),
        [],
    )


EXPERT_MESH = {"batch": 2, "expert": 2, "model": 2}


def test_expert_mesh_axis_is_recognized_by_name():
    axes = resolve_mesh_axes({"model": 2, "expert": 2, "batch": 2})
    assert (axes.batch_axis, axes.model_axis, axes.expert_axis, axes.hidden_axis) == (
        "batch",
        "model",
        "expert",
        None,
    )
    mesh = keras.distribution.DeviceMesh(
        (2, 2, 2), ("batch", "expert", "model"), keras.distribution.list_devices()
    )
    assert resolve_mesh_axes(mesh).expert_axis == "expert"
    # An expert axis beside a batch axis alone, and beside a hidden axis.
    assert resolve_mesh_axes({"batch": 2, "expert": 4}).expert_axis == "expert"
    axes = resolve_mesh_axes({"batch": 1, "expert": 2, "model": 2, "x": 2})
    assert (axes.expert_axis, axes.hidden_axis) == ("expert", "x")
    assert resolve_mesh_axes({"batch": 2, "model": 4}).expert_axis is None


def test_more_unknown_axes_than_roles_still_fail():
    with pytest.raises(
        MeshError, match=r"Mesh axes \['a', 'b'\] have no role.*`expert`"
    ):
        resolve_mesh_axes({"batch": 2, "expert": 2, "model": 1, "a": 2, "b": 2})


def test_expert_axis_takes_the_experts_and_model_splits_each_expert():
    assert assign(experts_in(8), EXPERT_MESH) == (("expert", None, "model"), [])
    assert assign(experts_out(8), EXPERT_MESH) == (("expert", "model", None), [])
    # Other weights are replicated over the expert axis.
    assert assign(QUERY, EXPERT_MESH) == ((None, "model", None), [])
    assert assign(ROUTER, EXPERT_MESH) == ((None, None), [])


def test_expert_axis_without_model_axis():
    assert assign(experts_in(8), {"batch": 2, "expert": 4}) == (
        ("expert", None, None),
        [],
    )


def test_expert_axis_fallback_when_experts_do_not_divide():
    spec, notes = assign(experts_in(3), EXPERT_MESH)
    assert spec == (None, "expert", "model")
    assert notes == [
        "num_experts=3 does not divide by expert=2: sharded hidden_dim=16 over "
        "'expert' instead"
    ]


def test_expert_axis_with_fsdp_keeps_the_batch_axis_for_data():
    spec, _ = assign(experts_in(8), EXPERT_MESH, "fsdp")
    assert spec == ("expert", "batch", "model")
    spec, _ = assign(QUERY, EXPERT_MESH, "fsdp")
    assert spec == ("batch", "model", None)
