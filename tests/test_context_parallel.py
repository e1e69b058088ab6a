"""Context parallelism: the `context` mesh axis splits each sequence.

Roles, plans, layouts and the data layout here, with one training run;
integration/test_context_parallel_matrix.py trains every family on context
meshes, generates, saves and checks the compiled memory.
"""

import re

import keras
import pytest
import tiny_presets
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import vocabulary_size

import keras_hub_autodist
from keras_hub_autodist import MeshError
from keras_hub_autodist import SequenceLengthError
from keras_hub_autodist import StrategyError
from keras_hub_autodist.fitting import memory_factors
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.report import memory_verdict
from keras_hub_autodist.planning.distribution import ContextParallel
from keras_hub_autodist.planning.distribution import decoding
from keras_hub_autodist.planning.mesh import resolve_mesh_axes

CONTEXT = {"batch": 2, "context": 4}
CONTEXT_MODEL = {"batch": 1, "context": 4, "model": 2}


def device_mesh(mapping):
    devices = keras.distribution.list_devices()
    return keras.distribution.DeviceMesh(
        tuple(mapping.values()), tuple(mapping), devices
    )


def test_the_axis_named_context_or_given_takes_the_role():
    axes = resolve_mesh_axes({"batch": 2, "context": 2, "model": 2})
    assert (axes.batch_axis, axes.context_axis, axes.model_axis) == (
        "batch",
        "context",
        "model",
    )
    assert axes.hidden_axis is None
    named = resolve_mesh_axes({"batch": 2, "seq": 4}, context_axis="seq")
    assert named.context_axis == "seq" and named.model_axis is None
    assert resolve_mesh_axes({"batch": 2, "model": 4}).context_axis is None
    with pytest.raises(MeshError, match=r"`context_axis='batch'` is also the batch"):
        resolve_mesh_axes({"batch": 2, "model": 4}, context_axis="batch")
    with pytest.raises(MeshError, match=r"Received: context_axis='seq'"):
        resolve_mesh_axes({"batch": 2, "model": 4}, context_axis="seq")


def test_plan_pins_the_stream_and_the_key_value_blocks(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    plan = keras_hub_autodist.plan(preset, CONTEXT_MODEL)
    layouts = plan.activation_layouts()
    assert layouts["sequence_output_layernorm/output"] == ("batch", "context", None)
    kv_outputs = {k: v for k, v in layouts.items() if "key" in k or "value" in k}
    assert kv_outputs, layouts
    kv_rows = [r for r in plan.rows if "kv_heads" in r.logical_axes]
    for row in kv_rows:
        output = row.path[: -len("kernel")] + "output"
        (key,) = [k for k in kv_outputs if re.fullmatch(k, output)]
        # [batch, block of the sequence, kv heads as the kernel has them,
        # head_dim]
        heads = row.spec[row.logical_axes.index("kv_heads")]
        assert kv_outputs[key] == ("batch", "context", heads, None), row.path
    # Weights: replicated over the context axis under tp.
    assert all("context" not in row.spec for row in plan.rows)
    summary = plan.summary()
    assert "context parallel: on: each sequence split over 'context' into 4" in summary
    assert "context axis: context" in summary
    # The layout map Keras gets holds them, without clashing with weights.
    layout_map = plan.layout_map(device_mesh(CONTEXT_MODEL))
    assert tuple(layout_map["sequence_output_layernorm/output"].axes) == (
        "batch",
        "context",
        None,
    )


def test_fsdp_shards_weights_over_batch_and_context(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    plan = keras_hub_autodist.plan(preset, {"batch": 2, "context": 4}, strategy="fsdp")
    embedding = next(r for r in plan.rows if r.path.endswith("embeddings"))
    assert set(embedding.spec) - {None} == {"batch", "context"}, embedding.spec
    tp = keras_hub_autodist.plan(preset, {"batch": 2, "context": 4}, strategy="tp")
    assert plan.max_device_bytes < tp.max_device_bytes / 4


def test_the_estimate_splits_activations_over_the_context_axis(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    one = keras_hub_autodist.plan(preset, {"batch": 1, "model": 1})
    split = keras_hub_autodist.plan(preset, {"batch": 1, "context": 8})
    ratio = split.activation_bytes_per_device(
        1, 4096
    ) / one.activation_bytes_per_device(1, 4096)
    # Everything but the gathered keys and values is split 8 ways, and the
    # scores are one block of keys' per device instead of the sequence's.
    assert ratio < 0.2, ratio
    # The estimate grows linearly with the sequence, as the compiled step.
    doubled = split.activation_bytes_per_device(1, 65536)
    assert doubled / split.activation_bytes_per_device(1, 32768) <= 2.2
    assert split.activation_layouts() and not one.activation_layouts()


def test_a_context_axis_of_one_device_changes_nothing(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    plan = keras_hub_autodist.plan(preset, {"batch": 8, "context": 1})
    assert plan.activation_layouts() == {}
    assert "context parallel: off: the context axis (context) has one" in (
        plan.summary()
    )


def test_sequence_parallel_and_a_context_axis_are_refused(tiny_presets_dir):
    with pytest.raises(StrategyError, match=r"use one of them.*sequence_parallel"):
        keras_hub_autodist.plan(
            tiny_presets_dir["gemma_mqa"], CONTEXT_MODEL, sequence_parallel=True
        )


def test_data_is_split_on_the_sequence_except_while_decoding():
    mesh = device_mesh(CONTEXT)
    distribution = ContextParallel(
        layout_map=keras.distribution.LayoutMap(mesh),
        batch_dim_name="batch",
        context_dim_name="context",
    )
    assert tuple(distribution.get_data_layout((4, 16)).axes) == ("batch", "context")
    assert tuple(distribution.get_data_layout((4, 16, 8)).axes) == (
        "batch",
        "context",
        None,
    )
    assert tuple(distribution.get_data_layout((4,)).axes) == ("batch",)
    with decoding():
        assert tuple(distribution.get_data_layout((4, 16)).axes) == ("batch", None)
    with pytest.raises(SequenceLengthError, match=r"a multiple of 4.*\(4, 6\)"):
        distribution.get_data_layout((4, 6))


def test_training_matches_one_device_with_tokens_split(tiny_presets_dir):
    """Gemma (one key/value head) on batch=2 x context=4: the losses and
    weights of one device, and the train step gets its token ids split on
    the sequence over the context axis."""
    preset = tiny_presets_dir["gemma_mqa"]
    batch = batch_for(preset, sequence_length=16)
    lm = assert_same_training(preset, batch=batch, device_mesh=CONTEXT)
    seen = []
    step = lm.train_function

    def recording(state, batches):
        # The batches Keras feeds the step, as it placed them on the mesh.
        batches = list(batches)
        seen.extend(x["token_ids"].sharding.spec for x, *_ in batches)
        return step(state, iter(batches))

    lm.train_function = recording
    lm.train_on_batch(*batch)
    assert [tuple(spec) for spec in seen] == [("batch", "context")]
    logits = lm.predict(batch[0], verbose=0)
    rows = len(batch[0]["token_ids"])
    assert logits.shape == (rows, 16, vocabulary_size(preset))


def test_attention_takes_xlas_path_on_a_context_mesh(tiny_presets_dir):
    """Fused kernels can't be split along the sequence: keras-hub's own
    choice is turned off on every attention layer of a context-parallel
    model, and Keras' only inside its distribution's scope."""
    import keras_hub
    from keras.src.backend.jax import nn as jax_nn

    from keras_hub_autodist import compat

    preset = tiny_presets_dir["gemma_mqa"]
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=CONTEXT
    )
    layers = [
        layer
        for layer in compat.sublayers(lm)
        if hasattr(layer, "_use_fused_attention_op")
    ]
    assert len(layers) == 2  # one per decoder block
    # On CPU keras-hub answers no by itself: the layers' own answer is what
    # changes on GPU and TPU.
    assert all("_use_fused_attention_op" in vars(layer) for layer in layers)
    assert not any(layer._use_fused_attention_op() for layer in layers)
    plain = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    for layer in compat.sublayers(plain):
        assert "_use_fused_attention_op" not in vars(layer)

    original = jax_nn._can_use_flash_attention
    distribution = keras_hub_autodist.distribution_of(lm).distribution
    q = keras.ops.ones((2, 8, 4, 16), "float16")
    with distribution.scope():
        assert compat.installed_patches() == {"flash_attention_check": 1}
        assert jax_nn._can_use_flash_attention(q, q, q, None) is False
    assert compat.installed_patches() == {}
    assert jax_nn._can_use_flash_attention is original


def test_the_advice_proposes_a_context_axis_when_it_makes_a_run_fit(
    real_configs, monkeypatch
):
    """One sequence of 4096 tokens of Gemma 2B on a TPU v3-8 split 8 ways on
    the batch axis: 7 of 8 devices would hold padding, each device a whole
    sequence. 4 blocks of it would fit (attention per device holds one block
    of keys' scores), but a context axis of 4 leaves a batch axis of 2 for
    one sequence, one device of 2 computing padding: the advice splits the
    sequence over all 8, where no device holds padding. Counted with a GPU
    compiler's buffers and no margin for the estimate, so that the verdict
    is yes or NO (the measured margins, or a TPU's rematerialization, leave
    some of these steps a maybe)."""
    monkeypatch.setitem(memory_factors.ESTIMATE_MARGIN, "gpu", 0.0)
    monkeypatch.setitem(memory_factors.OVER_ESTIMATE_MARGIN, "gpu", 0.0)
    gemma = next(path for path in real_configs if path.name == "gemma_2b")
    plan = keras_hub_autodist.plan(
        gemma, {"batch": 8, "model": 1}, device_memory="v3-8", lora_rank=4
    )
    assert memory_verdict(plan, 1, 4096, platform="gpu")[0] is False
    advice = plan.fit_advice(1, 4096, platform="gpu")
    assert advice[0].startswith(
        "split each sequence over a context axis: "
        "`device_mesh={'batch': 1, 'model': 1, 'context': 8}`"
    ), advice
    for sizes, fits in (
        ({"batch": 1, "model": 1, "context": 8}, True),
        ({"batch": 2, "model": 1, "context": 4}, True),
        ({"batch": 4, "model": 1, "context": 2}, False),
    ):
        split = keras_hub_autodist.plan(gemma, sizes, device_memory="v3-8", lora_rank=4)
        assert memory_verdict(split, 1, 4096, platform="gpu")[0] is fits, sizes
    # With two sequences, the batch axis of 2 holds no padding: the
    # smallest context axis that fits is proposed.
    assert plan.fit_advice(2, 4096, platform="gpu")[0].startswith(
        "split each sequence over a context axis: "
        "`device_mesh={'batch': 2, 'model': 1, 'context': 4}`"
    )


def test_a_padded_batch_is_counted_as_padded(tiny_presets_dir):
    """A batch of 1 on a batch axis of 8 is padded to 8 rows: each device
    holds a whole sequence, as with a batch of 8."""
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], {"batch": 8})
    one = plan.activation_bytes_per_device(1, 512)
    assert one == plan.activation_bytes_per_device(8, 512)


def sized_config(family: str) -> dict:
    """`family`'s tiny preset (`tiny_presets`) at sizes whose activations
    outweigh its weights at a few thousand tokens, as a config dict."""
    specs = {**tiny_presets.DENSE_FAMILIES, **tiny_presets.MOE_FAMILIES}
    backbone, _, config = specs[family]
    sizes = dict(vocabulary_size=4096, hidden_dim=128, intermediate_dim=512)
    for name, size in (("head_dim", 32), ("max_position_embeddings", 65536)):
        if name in config:
            sizes[name] = size
    return {"class_name": backbone.__name__, "config": {**config, **sizes}}


def assert_estimate_near_the_compiled_step(family, mesh, sequence_length):
    """The CPU estimate of one sequence's Adam step within 15% of XLA's
    compiled peak per device, as on a mesh without a context axis
    (integration/test_compiled_memory_matrix.py)."""
    config = sized_config(family)
    plan = keras_hub_autodist.plan(config, mesh, strategy="tp")
    compiled = compiled_memory(plan, 1, sequence_length, preset=config)
    estimate = step_memory.step_estimate(plan, 1, sequence_length, platform="cpu")
    ratio = estimate.total_bytes / compiled.peak_bytes
    assert 0.85 < ratio < 1.15, (family, mesh, sequence_length, ratio)


@pytest.mark.parametrize("family", ["smollm3", "gemma4"])
def test_the_estimate_on_a_context_mesh_is_near_the_compiled_step(family):
    """SmolLM3's flat query kernel gives no head shape of its own (its
    output projection does); Gemma 4 takes `position_ids` too. Each family's
    attention runs per device: one block of keys' scores, not the
    sequence's (integration/test_context_parallel_matrix.py has the others)."""
    assert_estimate_near_the_compiled_step(family, {"batch": 1, "context": 8}, 4096)
