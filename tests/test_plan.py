"""The planner against the real configs in tests/data/presets (no weights)."""

import dataclasses
import json
import re
import tracemalloc

import jax
import keras
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import MeshError
from keras_hub_autodist import PlanError
from keras_hub_autodist import PresetError
from keras_hub_autodist import StrategyError
from keras_hub_autodist import UnsupportedArchitectureError
from keras_hub_autodist.architectures.registry import BUILTIN_ARCHITECTURES
from keras_hub_autodist.architectures.registry import architecture_for
from keras_hub_autodist.planning import abstract
from keras_hub_autodist.planning.shapes import architecture_weights
from keras_hub_autodist.reading.presets import read_preset_config

FSDP_MESHES = [
    {"batch": 8, "model": 1},
    {"batch": 4, "model": 2},
    {"batch": 2, "model": 4},
    {"model": 8, "batch": 8},
    {"batch": 16, "model": 4},
    {"batch": 4, "model": 16},
    {"batch": 16, "model": 16},
    {"batch": 32, "model": 8},
    {"batch": 64, "model": 4},
    {"batch": 256, "model": 1},
]


@pytest.mark.parametrize("model_size", [1, 2, 4, 8])
def test_tp_target_on_every_real_config(real_configs, model_size):
    for preset in real_configs:
        plan = keras_hub_autodist.plan(
            str(preset), {"batch": 1, "model": model_size}, strategy="tp"
        )
        assert plan.max_device_bytes <= 1.10 * plan.total_bytes / model_size, (
            preset.name,
            plan.max_device_bytes / (plan.total_bytes / model_size),
        )


@pytest.mark.parametrize(
    "mesh", FSDP_MESHES, ids=lambda m: "x".join(map(str, m.values()))
)
def test_fsdp_target_on_every_real_config(real_configs, mesh):
    devices = mesh["batch"] * mesh["model"]
    mesh_id = "x".join(map(str, mesh.values()))
    for preset in real_configs:
        plan = keras_hub_autodist.plan(str(preset), mesh, strategy="fsdp")
        ratio = plan.max_device_bytes / (plan.total_bytes / devices)
        if (preset.name, mesh_id) in EVEN_SHARDING_IMPOSSIBLE:
            assert ratio > 1.05
            assert_no_dimension_divides(plan, mesh["batch"])
            continue
        assert ratio <= 1.05, (preset.name, ratio)


# JAX shards a dimension only evenly. Qwen 2.5 0.5B on 256 devices in one
# axis: vocabulary 151936, hidden 896, 14 and 2 heads of 64 divide by at most
# 128; only the MLP (4864 = 19 x 256) can be split 256 ways. The same 256
# devices as 16 x 16 (above) meet the target.
EVEN_SHARDING_IMPOSSIBLE = {("qwen2.5_0.5b", "256x1")}


def assert_no_dimension_divides(plan, size):
    """Every weight left whole on the batch axis has no dimension that
    divides by its size: no even layout shards it further."""
    whole = [row for row in plan.rows if plan.batch_axis not in row.spec]
    assert whole
    for row in whole:
        assert all(dim % size for dim in row.shape), (row.path, row.shape)


def test_planning_is_fast_and_allocates_no_weights(real_configs):
    folder = REAL_PRESETS / "llama3.1_70b"
    keras_hub_autodist.plan(
        str(real_configs[0]), {"batch": 2, "model": 4}
    )  # warm imports
    arrays_before = {id(array) for array in jax.live_arrays()}
    tracemalloc.start()
    for preset in [folder, *real_configs]:
        plan = keras_hub_autodist.plan(str(preset), {"batch": 16, "model": 16})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1024**3
    # Earlier tests' arrays may be collected meanwhile; none may appear.
    assert not {id(array) for array in jax.live_arrays()} - arrays_before
    plan = keras_hub_autodist.plan(
        str(folder), {"batch": 16, "model": 16}, dtype="bfloat16"
    )
    assert plan.num_parameters == 70_553_706_496
    assert plan.strategy == "fsdp"  # 70B doesn't fit 16 GiB devices with tp
    # Re-planning on another mesh reuses the abstract build (from memory, or
    # from the disk cache): nothing is built again.
    misses = abstract._cached_variables.cache_info().misses
    keras_hub_autodist.plan(str(folder), {"batch": 4, "model": 2})
    assert abstract._cached_variables.cache_info().misses == misses


def test_abstract_meshes_of_thousands_of_devices(real_configs):
    plan = keras_hub_autodist.plan(
        str(real_configs[0]), {"batch": 512, "model": 8}, strategy="fsdp"
    )
    assert plan.mesh_axes.num_devices == 4096


def test_gemma_2b_single_key_value_head_is_not_split_on_two_devices():
    # A static layout map (keras-hub's `GemmaBackbone.get_layout_map`) shards
    # the key/value kernels' heads dimension, of size 1 here, over "model",
    # which no mesh can hold. The plan keeps that dimension whole and says
    # why, and every dimension it shards divides by its axis.
    preset = str(REAL_PRESETS / "gemma_2b")
    info = read_preset_config(preset)
    weights = architecture_weights(
        architecture_for(info.backbone_cls), info.config, info.backbone_cls
    )
    key = next(w for w in weights if w.path.endswith("0/attention/key/kernel"))
    assert key.shape[0] == 1

    plan = keras_hub_autodist.plan(preset, {"batch": 1, "model": 2}, strategy="tp")
    row = next(r for r in plan.rows if r.path == key.path)
    assert row.spec[0] is None
    assert "num_key_value_heads=1 does not divide by model=2" in row.note
    assert plan.max_device_bytes <= 1.10 * plan.total_bytes / 2
    for row in plan.rows:
        for size, axis in zip(row.shape, row.spec):
            assert axis is None or size % plan.mesh_axes.size(axis) == 0, row


def test_llama_untied_output_embedding_is_sharded_and_kv_never_on_batch():
    # A static layout map (keras-hub's `LlamaBackbone.get_layout_map`) matches
    # no key for reverse_embeddings (fully replicated, ~1 GB per device for
    # Llama 3 8B in bf16) and shards key/value heads on the *batch* axis.
    # The plan, and the layout map Keras gets from it, shard both on "model".
    preset = str(REAL_PRESETS / "llama3_8b")
    mesh = keras.distribution.DeviceMesh(
        (4, 2), ("batch", "model"), keras.distribution.list_devices()
    )
    plan = keras_hub_autodist.plan(preset, mesh, strategy="tp", dtype="bfloat16")
    rows = {r.path: r for r in plan.rows}
    assert rows["token_embedding/reverse_embeddings"].spec == (None, "model")
    assert rows["transformer_layer_0/self_attention/key/kernel"].spec == (
        None,
        "model",
        None,
    )
    assert rows["transformer_layer_0/self_attention/query/kernel"].spec == (
        None,
        "model",
        None,
    )
    layout_map = plan.layout_map(mesh)
    assert tuple(layout_map["token_embedding/reverse_embeddings"].axes) == (
        None,
        "model",
    )
    key_axes = layout_map["transformer_layer_0/self_attention/key/kernel"].axes
    assert "batch" not in key_axes


def test_hidden_axis_shards_embed_dim(real_configs):
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "llama3_8b"),
        {"batch": 2, "model": 2, "tensor2": 2},
        strategy="tp",
    )
    rows = {r.path: r for r in plan.rows}
    assert rows["transformer_layer_3/feedforward_gate_dense/kernel"].spec == (
        "tensor2",
        "model",
    )
    assert plan.max_device_bytes <= 1.10 * plan.total_bytes / 4


def test_fsdp_shards_over_batch_axis_and_tp_does_not():
    preset = str(REAL_PRESETS / "llama3.2_1b")
    tp = keras_hub_autodist.plan(preset, {"model": 2, "batch": 4}, strategy="tp")
    fsdp = keras_hub_autodist.plan(preset, {"model": 2, "batch": 4}, strategy="fsdp")
    assert all("batch" not in r.spec for r in tp.rows)
    assert fsdp.max_device_bytes * 3.9 < tp.max_device_bytes
    assert tp.training_bytes_per_device("adam") == 4 * tp.max_device_bytes


def test_auto_strategy_uses_device_memory():
    preset = str(REAL_PRESETS / "gemma_2b")
    roomy = keras_hub_autodist.plan(
        preset, {"batch": 2, "model": 4}, device_memory=64 * 1024**3
    )
    tight = keras_hub_autodist.plan(
        preset, {"batch": 2, "model": 4}, device_memory=8 * 1024**3
    )
    assert roomy.strategy == "tp" and "fit in 80% of 64.0 GiB" in roomy.strategy_reason
    assert tight.strategy == "fsdp" and "over 80% of 8.0 GiB" in tight.strategy_reason


def test_device_memory_from_environment(monkeypatch):
    monkeypatch.setenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "64")
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 2, "model": 4}
    )
    assert plan.device_memory_bytes == 64 * 1024**3
    monkeypatch.setenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "lots")
    with pytest.raises(MeshError, match="must be a number of GiB.*Received: .*'lots'"):
        keras_hub_autodist.plan(
            str(REAL_PRESETS / "gemma_2b"), {"batch": 2, "model": 4}
        )


def test_dtype_sets_bytes():
    preset = str(REAL_PRESETS / "gemma_7b")
    f32 = keras_hub_autodist.plan(preset, {"batch": 1, "model": 2}, strategy="tp")
    bf16 = keras_hub_autodist.plan(
        preset, {"batch": 1, "model": 2}, strategy="tp", dtype="bfloat16"
    )
    mixed = keras_hub_autodist.plan(
        preset, {"batch": 1, "model": 2}, strategy="tp", dtype="mixed_bfloat16"
    )
    assert f32.total_bytes == 2 * bf16.total_bytes == mixed.total_bytes
    assert bf16.dtype == "bfloat16" and mixed.dtype == "float32"


def test_str_is_a_readable_table():
    text = str(
        keras_hub_autodist.plan(
            str(REAL_PRESETS / "gemma_2b"), {"batch": 1, "model": 2}
        )
    )
    assert re.search(
        r"decoder_block_\*/attention/key/kernel\s+18\s+\(1, 2048, 256\)", text
    )
    assert (
        "per device:" in text
        and "strategy:" in text
        and "(36 weights), noted in the table" in text
    )


def test_get_layout_map_for_own_scope():
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras_hub_autodist.get_layout_map(
        str(REAL_PRESETS / "gemma_7b"), mesh, strategy="tp"
    )
    assert layout_map["decoder_block_3/attention/key/kernel"].axes == (
        "model",
        None,
        None,
    )
    with pytest.raises(MeshError, match="needs a real `keras.distribution.DeviceMesh`"):
        keras_hub_autodist.get_layout_map(str(REAL_PRESETS / "gemma_7b"), {"batch": 8})


def test_layout_map_needs_matching_device_mesh():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 2, "model": 4}
    )
    with pytest.raises(MeshError, match="needs a `keras.distribution.DeviceMesh`"):
        plan.layout_map()
    other = keras.distribution.DeviceMesh(
        (4, 2), ("batch", "model"), keras.distribution.list_devices()
    )
    with pytest.raises(MeshError, match=r"does not match the plan.*Received: axes"):
        plan.layout_map(other)


def test_unknown_strategy():
    with pytest.raises(StrategyError, match=r"Received: strategy='zero3'"):
        keras_hub_autodist.plan(
            str(REAL_PRESETS / "gemma_7b"), {"batch": 8}, strategy="zero3"
        )


def test_preset_without_config_json(tmp_path):
    with pytest.raises(PresetError, match=r"config.json.*Received: preset="):
        keras_hub_autodist.plan(str(tmp_path), {"batch": 8})
    with pytest.raises(PresetError, match=r"Received: preset=.*does-not-exist"):
        keras_hub_autodist.plan(str(tmp_path / "does-not-exist"), {"batch": 8})
    with pytest.raises(PresetError, match=r"take a preset.*Received: preset=42"):
        keras_hub_autodist.plan(42, {"batch": 8})


def test_unsupported_architecture_lists_supported(tmp_path):
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 16,
        "type_vocab_size": 2,
        "hidden_dropout_prob": 0.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"no layout for BertBackbone\. Supported backbones: "
        + re.escape(", ".join(sorted(BUILTIN_ARCHITECTURES)))
        + r".*docs/architectures.md",
    ):
        keras_hub_autodist.plan(str(tmp_path), {"batch": 8})


def test_multimodal_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llava",
                "vision_config": {"image_size": 336},
                "text_config": {},
            }
        )
    )
    with pytest.raises(
        UnsupportedArchitectureError,
        match="vision towers of gemma3 only.*model_type='llava'",
    ):
        keras_hub_autodist.plan(str(tmp_path), {"batch": 8})


def test_multimodal_gemma3_checkpoint_plans_its_vision_tower(tmp_path):
    text = dict(
        model_type="gemma3_text",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        rms_norm_eps=1e-6,
        sliding_window=4,
        rope_theta=10000.0,
    )
    vision = dict(
        image_size=16,
        patch_size=4,
        num_attention_heads=2,
        hidden_size=16,
        num_hidden_layers=2,
        intermediate_size=32,
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "gemma3", "text_config": text, "vision_config": vision}
        )
    )
    plan = keras_hub_autodist.plan(str(tmp_path), {"batch": 2, "model": 4})
    rows = {row.path: row for row in plan.rows}
    query = rows["image_encoder/encoder_block_1/multi_head_attention/query_proj/kernel"]
    assert query.spec == (None, "model")
    assert plan.backbone_class == "Gemma3Backbone"


def test_plan_says_when_it_does_not_fit():
    # gemma_7b on model=3 needs ~56 GiB per device to train with Adam.
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 1, "model": 3}
    )
    assert not plan.fits
    summary = plan.summary()
    assert "fits: NO, training with adam, weights+grads+optimizer state only" in summary
    assert "needs 56.41 GiB per device" in summary
    # The advice names only what makes it fit on these 3 devices: LoRA (the
    # 14.1 GiB of float32 weights fit 16 GiB), not bfloat16 alone (28 GiB
    # of state) nor more devices.
    assert "fine-tune with LoRA" in summary
    assert "`dtype='bfloat16'`" not in summary
    assert "devices on the 'model' axis" not in summary
    assert "assumed: no device reported its memory" in summary
    roomy = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"),
        {"batch": 1, "model": 3},
        device_memory=80 * 1024**3,
    )
    assert roomy.fits and "fits: yes" in roomy.summary()
    assert "of 80.00 GiB (given)" in roomy.summary()


def test_plan_says_where_device_memory_comes_from(monkeypatch):
    preset = str(REAL_PRESETS / "gemma_2b")
    assumed = keras_hub_autodist.plan(preset, {"batch": 2, "model": 4})
    assert assumed.device_memory_source == "assumed"
    monkeypatch.setenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "24")
    from_env = keras_hub_autodist.plan(preset, {"batch": 2, "model": 4})
    assert from_env.device_memory_source == "env"
    assert "$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB" in from_env.summary()


def test_device_memory_reported_by_the_devices():
    from keras_hub_autodist.fitting.device_memory import device_memory_info

    class Device:
        client = None

        def memory_stats(self):
            return {"bytes_limit": 12 * 1024**3}

    device = Device()
    device.client = type("Client", (), {"local_devices": lambda self: [device]})()
    assert device_memory_info([device]) == (12 * 1024**3, "reported")
    with pytest.raises(PlanError, match=r"Received: device_memory=-5"):
        device_memory_info([], -5)


def test_auto_never_picks_fsdp_on_a_batch_axis_of_one():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 1, "model": 2}
    )
    assert plan.strategy == "tp"
    assert "fsdp would shard nothing more on a batch axis of size 1" in (
        plan.strategy_reason
    )


def _note_agrees_with_row(plan, row, fields_to_axis):
    model = plan.mesh_axes.model_axis
    for part in row.note.split("; "):
        replicated = re.search(r"replicated over '(\w+)'", part)
        if replicated:
            assert replicated.group(1) not in row.spec, (row, part)
        sharded = re.search(r"sharded (\w+)=\d+ over '(\w+)' instead", part)
        if sharded:
            logical = fields_to_axis[sharded.group(1)]
            dim = row.logical_axes.index(logical)
            assert row.spec[dim] == sharded.group(2), (row, part)
        if "query heads are sharded on head_dim" in part:
            layer = row.path.rsplit("/", 2)[0]
            query = next(
                r
                for r in plan.rows
                if r.path.startswith(layer) and "heads" in r.logical_axes
            )
            assert query.spec[query.logical_axes.index("head_dim")] == model
            assert row.spec[row.logical_axes.index("head_dim")] == model, row
        if "(K/V replicated" in part:
            assert model not in row.spec, (row, part)
        if "(K/V sharded on head_dim" in part:
            assert row.spec[row.logical_axes.index("head_dim")] == model, row


@pytest.mark.parametrize("model_size", [2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
def test_every_note_agrees_with_its_row(real_configs, model_size, strategy):
    for preset in real_configs:
        plan = keras_hub_autodist.plan(
            str(preset), {"batch": 2, "model": model_size}, strategy=strategy
        )
        handler = architecture_for_plan(plan)
        # `expert_<axis>` names the field of <axis> in expert kernels.
        fields_to_axis = {
            f: a.removeprefix("expert_") for a, f in handler.config_fields.items()
        }
        for row in plan.rows:
            if row.note:
                _note_agrees_with_row(plan, row, fields_to_axis)


def architecture_for_plan(plan):
    from keras_hub_autodist.architectures.registry import architecture_by_name

    return architecture_by_name(plan.backbone_class)


def test_query_replicated_means_no_head_dim_note():
    # gemma_7b on model=3: neither 16 heads nor head_dim 256 divide by 3, so
    # the query is replicated; K/V notes must not claim it is on head_dim.
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 1, "model": 3}, strategy="tp"
    )
    for row in plan.rows:
        assert "query heads are sharded on head_dim" not in row.note, row


def test_plan_errors_are_package_errors():
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), {"batch": 2})
    with pytest.raises(PlanError, match=r"Received: optimizer='lion'"):
        plan.training_bytes_per_device("lion")


def test_a_rule_whose_weights_get_different_layouts_is_keyed_per_weight():
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), {"batch": 2})
    row = next(r for r in plan.rows if r.path.endswith("0/ffw_linear/kernel"))
    other = dataclasses.replace(
        row, path=row.path + "x", spec=("batch",) * len(row.spec)
    )
    layouts = plan.replace(rows=plan.rows + (other,)).weight_layouts()
    assert row.pattern not in layouts
    assert layouts[re.escape(row.path)] == row.spec
    assert layouts[re.escape(row.path.replace("_0/", "_1/"))] == row.spec
    assert layouts[re.escape(other.path)] == other.spec


def test_plan_auto_mesh_over_the_visible_devices():
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), "auto")
    assert plan.mesh_axes.num_devices == len(jax.devices())
    assert "auto over 8 devices" in plan.mesh_reason
    with pytest.raises(MeshError, match=r"Received: device_mesh='all'"):
        keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), "all")


def _kv_row(plan):
    return next(r for r in plan.rows if "kv_heads" in r.logical_axes)


def test_kv_replicated_when_it_fits_and_keeps_the_target():
    # gemma3_1b (one kv head) on model=4: replicated K/V hold 1.046x the
    # ideal tp bytes, within the 1.10x target and far from 16 GiB; the old
    # 3% tolerance sharded head_dim here (extra collectives in attention).
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma3_1b"), {"batch": 1, "model": 4}, strategy="tp"
    )
    row = _kv_row(plan)
    assert row.spec == (None, None, None)
    assert re.search(
        r"\(K/V replicated over 'model': fewer collectives; weights\+grads\+Adam "
        r"3\.90 GiB per device fit in 16\.00 GiB\)",
        row.note,
    ), row.note
    assert plan.max_device_bytes <= 1.10 * plan.total_bytes / 4


def test_kv_sharded_on_head_dim_when_replicated_does_not_fit():
    preset = str(REAL_PRESETS / "gemma3_1b")
    mesh = {"batch": 1, "model": 4}
    replicated = keras_hub_autodist.plan(preset, mesh, strategy="tp")
    need = replicated.training_bytes_per_device("adam")
    # Between the head_dim plan's need and the replicated plan's.
    plan = keras_hub_autodist.plan(
        preset, mesh, strategy="tp", device_memory=need - 1024**2
    )
    row = _kv_row(plan)
    assert row.spec == (None, None, "model")
    assert plan.fits and replicated.fits  # replicated fits 16 GiB
    assert re.search(
        r"\(K/V sharded on head_dim: replicating them over 'model' would need "
        r"3\.90 GiB > 3\.90 GiB per device \(weights\+grads\+Adam\), sharded "
        r"needs 3\.7\d GiB\)",
        row.note,
    ), row.note


def test_kv_replicated_when_neither_layout_fits():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma3_1b"),
        {"batch": 1, "model": 4},
        strategy="tp",
        device_memory=1024**3,
    )
    row = _kv_row(plan)
    assert row.spec == (None, None, None)
    assert "(neither K/V layout fits 1.00 GiB)" in row.note
    assert not plan.fits


@pytest.mark.parametrize(
    "preset, mesh, strategy, ratio",
    [
        ("gemma2_2b", {"batch": 1, "model": 8}, "tp", "1.329x"),
        ("llama3_8b", {"batch": 16, "model": 16}, "fsdp", "1.502x"),
    ],
)
def test_kv_sharded_on_head_dim_when_replicated_breaks_the_target(
    preset, mesh, strategy, ratio
):
    # Replicating K/V here would hold `ratio` x the ideal per-device bytes:
    # the per-device parameter targets win over the collectives saved.
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / preset), mesh, strategy=strategy)
    row = _kv_row(plan)
    assert row.spec[row.logical_axes.index("head_dim")] == "model"
    assert (
        f"replicating them over 'model' would hold {ratio} the ideal per-device "
        f"parameter bytes, over the" in row.note
    ), row.note


def test_a_plan_is_a_frozen_value():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"),
        {"batch": 2, "model": 2},
        sequence_parallel=True,
    )
    with pytest.raises(AttributeError, match=r"frozen value.*plan\.replace"):
        plan.strategy = "fsdp"
    with pytest.raises(AttributeError, match=r"frozen value.*Received: del strategy"):
        del plan.strategy
    assert isinstance(plan.rows, tuple)
    with pytest.raises(TypeError):
        plan.config_fields["heads"] = "x"
    changed = plan.replace(mesh_reason="by hand")
    assert (changed.mesh_reason, plan.mesh_reason) == ("by hand", "")
    # Every other field is carried over, the sequence-parallel ones included.
    assert {**vars(changed), "mesh_reason": ""} == vars(plan)
    assert changed.sequence_parallel and changed.activation_layouts()
    with pytest.raises(PlanError, match=r"no field \['colour'\].*Received"):
        plan.replace(colour="red")


def only_fallback(plan, path):
    """The row of `path` and its one fallback."""
    row = next(r for r in plan.rows if r.path == path)
    (fallback,) = row.fallbacks
    return row, fallback


def test_fallbacks_are_structured_and_their_text_is_derived():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 1, "model": 2}, strategy="tp"
    )
    row, fallback = only_fallback(plan, "decoder_block_0/attention/key/kernel")
    assert (
        fallback.weight,
        fallback.dimension,
        fallback.wanted,
        fallback.mesh_axis,
        fallback.chosen,
    ) == ("decoder_block_0/attention/key/kernel", 0, "kv_heads", "model", None)
    assert fallback.reason == "num_key_value_heads=1 does not divide by model=2"
    assert row.note == str(fallback)
    assert row.note.startswith(
        "num_key_value_heads=1 does not divide by model=2: replicated over 'model'"
    )
    assert fallback.policy  # the key/value policy says why it replicated


def test_a_fallback_to_another_dimension_records_it():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "llama3_8b"), {"batch": 16, "model": 16}, strategy="fsdp"
    )
    row, fallback = only_fallback(plan, "transformer_layer_0/self_attention/key/kernel")
    assert (
        fallback.dimension,
        fallback.wanted,
        fallback.mesh_axis,
        fallback.chosen,
        fallback.chosen_dimension,
        fallback.chosen_label,
    ) == (1, "kv_heads", "model", "head_dim", 2, "head_dim=128")
    assert row.spec[fallback.chosen_dimension] == "model"
    assert row.note == str(fallback)
    assert row.note.startswith(
        "num_key_value_heads=8 does not divide by model=16: sharded "
        "head_dim=128 over 'model' instead ("
    )


def test_counts_have_their_noun_in_the_right_number():
    preset = str(REAL_PRESETS / "gemma_2b")
    one = keras_hub_autodist.plan(preset, "auto", num_devices=1)
    assert "auto over 1 device:" in one.summary(), one.summary()
    assert "fallbacks: none" in one.summary()
    many = keras_hub_autodist.plan(preset, "auto", num_devices=8)
    assert "auto over 8 devices:" in many.summary()
