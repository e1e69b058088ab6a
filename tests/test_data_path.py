"""The data path reads top to bottom: config → weights → plan → load →
verify → bind, each step once, and the plan is a value."""

import dataclasses

import keras
import keras_hub
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import pipeline
from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.fitting import planner
from keras_hub_autodist.planning.mesh import MeshAxes
from keras_hub_autodist.planning.options import PlanOptions

STEPS = (
    "read_preset_config",
    "model_weights",
    "plan_model",
    "sharded_loading",
    "verify_layouts",
    "bind",
)


def test_from_preset_runs_each_step_once_in_order(tiny_presets_dir, monkeypatch):
    called = []
    for name in STEPS:
        real = getattr(pipeline, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            called.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(pipeline, name, spy)
    keras_hub.models.GemmaCausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 2, "model": 4}
    )
    assert called == list(STEPS)


@pytest.mark.parametrize("device_mesh", [{"batch": 2, "model": 4}, "auto"])
def test_auto_choices_make_one_plan(device_mesh, monkeypatch):
    """The alternatives (meshes, strategies, key/value layouts) are costed
    in one pass; only the chosen one becomes a `LayoutPlan`."""
    made = []

    class Counted(planner.LayoutPlan):
        def __post_init__(self):
            made.append(self.strategy)
            super().__post_init__()

    monkeypatch.setattr(planner, "LayoutPlan", Counted)
    preset = str(REAL_PRESETS / "gemma_2b")
    keras_hub_autodist.plan(preset, device_mesh, strategy="auto")
    assert len(made) == 1


def test_a_plan_holds_values_not_a_device_mesh():
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), mesh)
    assert isinstance(plan.mesh_axes, MeshAxes)
    assert (plan.mesh_axes.axis_names, plan.mesh_axes.shape) == (
        ("batch", "model"),
        (2, 4),
    )
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        assert not isinstance(value, keras.distribution.DeviceMesh), field.name
    assert all(isinstance(row, Weight) for row in plan.rows)
    assert plan.layout_map(mesh)["token_embedding/embeddings"] is not None


def test_one_record_describes_a_weight_from_build_to_plan():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 2, "model": 4}, dtype="bfloat16"
    )
    row = next(r for r in plan.rows if r.path.endswith("attention/query/kernel"))
    assert type(row) is keras_hub_autodist.PlanRow is Weight
    assert row.axes == row.logical_axes == ("heads", "embed", "head_dim")
    assert row.bytes == 2 * row.shape[0] * row.shape[1] * row.shape[2]
    assert row.device_bytes * row.shards == row.bytes


def test_a_documented_module_that_moved_keeps_its_former_path():
    from keras_hub_autodist.fitting import step_memory

    with pytest.warns(DeprecationWarning, match="fitting.step_memory"):
        assert keras_hub_autodist.step_memory is step_memory


BAD_OPTIONS = [
    ({"strategy": "zero"}, StrategyError, r"Received: strategy='zero'"),
    ({"strict": "no"}, PlanError, r"Received: strict='no'"),
    ({"sequence_parallel": 1}, StrategyError, r"sequence_parallel=1"),
    ({"batch_axis": 3}, MeshError, r"Received: batch_axis=3"),
    ({"device_memory": 10**400}, PlanError, r"at most .* bytes"),
    ({"device_memory": float("inf")}, PlanError, r"device_memory=inf"),
]
# A device's name is looked up by the fitting stage, where its memory is;
# `plan()` still refuses an unknown one before reading the preset.
BAD_DEVICE = [({"device_memory": "16GB"}, PlanError, r"device_memory='16GB'")]


@pytest.mark.parametrize(
    "options, error, match",
    BAD_OPTIONS,
)
def test_options_are_validated_in_one_place(options, error, match):
    with pytest.raises(error, match=match):
        PlanOptions(**options)


@pytest.mark.parametrize("options, error, match", BAD_OPTIONS + BAD_DEVICE)
def test_plan_checks_its_options_before_reading_the_preset(options, error, match):
    with pytest.raises(error, match=match):
        keras_hub_autodist.plan("./no-such-folder", {"batch": 2}, **options)


def test_options_are_a_frozen_value():
    options = PlanOptions(device_memory=8.0 * 1024**3)
    assert options.device_memory == 8 * 1024**3
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strategy = "tp"


@pytest.mark.parametrize("progress", ["no", 0, "off"])
def test_progress_takes_a_bool(progress, tiny_presets_dir):
    with pytest.raises(ArgumentError, match=rf"Received: progress={progress!r}"):
        keras_hub.models.GemmaCausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"],
            device_mesh={"batch": 2, "model": 4},
            progress=progress,
        )


def test_load_stats_say_where_the_time_went(tiny_presets_dir):
    lm = keras_hub.models.GemmaCausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 2, "model": 4}
    )
    stats = keras_hub_autodist.load_stats(lm)
    assert stats.plan_seconds > 0 and stats.verify_seconds > 0
    assert stats.build_seconds > 0 and stats.read_seconds >= 0
    parts = stats.build_seconds + stats.read_seconds + stats.transfer_seconds
    assert parts == pytest.approx(stats.seconds)
