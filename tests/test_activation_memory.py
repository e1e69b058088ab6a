"""`LayoutPlan.activation_bytes_per_device`: the documented formula, checked
by hand on real configs (no compile), and against XLA on a tiny model."""

import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import PlanError
from keras_hub_autodist.fitting import step_memory


def _plan(mesh, strategy="tp", preset="gemma_2b"):
    return keras_hub_autodist.plan(str(REAL_PRESETS / preset), mesh, strategy=strategy)


def test_gemma_2b_by_hand():
    # gemma_2b: 18 blocks, d=2048, 8 query heads and 1 kv head of 256,
    # gated MLP of 2 x 16384, vocab 256000, float32. Mesh 2 x 4: K/V are
    # replicated over 'model', the rest is split 4 ways on it.
    # Per block one and a half buffers of the scores and a whole mask;
    # two more score buffers for the one block being differentiated.
    plan = _plan({"batch": 2, "model": 4})
    b, s = 8 / 2, 128
    block = (
        4 * b * s * 2048
        + 2 * b * s * 8 * 256 / 4
        + 2 * b * s * 1 * 256
        + 1.5 * b * 8 * s * s / 4
        + b * s * s
        + 2 * 2 * b * s * 16384 / 4
    )
    one_block = 2 * b * 8 * s * s / 4
    head = 2 * b * s * 2048 + 3 * b * s * 256000 / 4
    expected = int((18 * block + one_block + head) * 4)
    assert plan.activation_bytes_per_device(8, 128) == expected


def test_scales_with_batch_and_sequence():
    plan = _plan({"batch": 1, "model": 8}, preset="llama3.2_1b")
    base = plan.activation_bytes_per_device(4, 256)
    assert plan.activation_bytes_per_device(8, 256) == pytest.approx(2 * base, 1e-6)
    # Linear terms double, the attention scores (s^2) quadruple.
    doubled = plan.activation_bytes_per_device(4, 512)
    assert 2 * base < doubled < 4 * base


def test_divides_by_the_batch_axis():
    one = _plan({"batch": 1, "model": 4}).activation_bytes_per_device(16, 64)
    four = _plan({"batch": 4, "model": 4}).activation_bytes_per_device(16, 64)
    assert four == pytest.approx(one / 4, rel=1e-6)
    # fsdp shards weights over the batch axis, not activations: the same
    # activations, plus each weight split over the batch axis gathered whole
    # over it (the other 3 quarters of what the device holds of it), as many
    # times as XLA's CPU backend keeps it.
    fsdp = _plan({"batch": 4, "model": 4}, strategy="fsdp")
    gathered = sum(3 * row.device_bytes for row in fsdp.rows if "batch" in row.spec)
    copies = step_memory.ACTIVATION_FACTORS["cpu"]["gathered_weights"]
    assert gathered > 0 and copies >= 1
    assert fsdp.activation_bytes_per_device(16, 64) == four + copies * gathered


def test_fsdp_without_a_model_axis_counts_one_gathered_share():
    """With every device on the batch axis XLA gathers each weight where
    it is used and frees it: about the device's own share is live, not two
    copies of everything gathered."""
    tp = _plan({"batch": 8, "model": 1})
    fsdp = _plan({"batch": 8, "model": 1}, strategy="fsdp")
    share = sum(row.device_bytes for row in fsdp.rows if "batch" in row.spec)
    assert share > 0
    terms = step_memory.activation_terms(fsdp, 16, 64)
    assert terms["gathered_weights"] == 0 and terms["gathered_share"] == share
    assert fsdp.activation_bytes_per_device(16, 64) == (
        tp.activation_bytes_per_device(16, 64) + share
    )


def test_a_whole_vocabulary_keeps_one_more_logits_buffer():
    # On one device the vocabulary is whole: XLA's CPU backend keeps a
    # fourth buffer of the logits; split over the model axis it does not.
    whole = step_memory.activation_terms(_plan({"batch": 1, "model": 1}), 1, 64)
    split = step_memory.activation_terms(_plan({"batch": 1, "model": 8}), 1, 64)
    assert whole["logits_whole"] == whole["logits"] == 64 * 256000
    assert split["logits_whole"] == 0 and split["logits"] == 64 * 256000 / 8
    assert step_memory.ACTIVATION_FACTORS["gpu"]["logits_whole"] == 0


def test_model_axis_shards_heads_mlp_and_logits_not_the_residual():
    one = _plan({"batch": 1, "model": 1}).activation_bytes_per_device(1, 64)
    eight = _plan({"batch": 1, "model": 8}).activation_bytes_per_device(1, 64)
    # Not 8x: the residual stream (and gemma_2b's single kv head) stay whole.
    assert one / 8 < eight < one / 2


def test_bfloat16_halves_the_estimate_on_accelerators_not_on_cpu():
    preset = str(REAL_PRESETS / "gemma_2b")
    mesh = {"batch": 2, "model": 4}
    f32 = keras_hub_autodist.plan(preset, mesh, dtype="float32")
    bf16 = keras_hub_autodist.plan(preset, mesh, dtype="bfloat16")
    # On an accelerator every buffer halves but the float32 logits of the
    # loss; XLA's CPU backend computes bfloat16 in float32.
    gpu_f32 = f32.activation_bytes_per_device(8, 128, "gpu")
    assert gpu_f32 / 2 < bf16.activation_bytes_per_device(8, 128, "gpu") < gpu_f32
    # On CPU the activations are those of float32, and XLA keeps a float32
    # copy of (most of) the bfloat16 weights from the forward pass to the
    # backward pass.
    copies = step_memory.ACTIVATION_FACTORS["cpu"]["weights_float32"]
    assert 0 < copies <= 1
    assert bf16.activation_bytes_per_device(8, 128) == pytest.approx(
        f32.activation_bytes_per_device(8, 128) + copies * 2 * bf16.max_device_bytes,
        abs=1,
    )
    assert step_memory.activation_terms(f32, 8, 128)["weights_float32"] == 0


def test_bfloat16_under_fsdp_gathers_one_copy_in_float32_on_cpu():
    preset = str(REAL_PRESETS / "llama3.2_1b")
    mesh = {"batch": 2, "model": 4}
    bf16 = keras_hub_autodist.plan(preset, mesh, dtype="bfloat16", strategy="fsdp")
    terms = step_memory.activation_terms(bf16, 2, 64)
    gathered = sum(row.device_bytes for row in bf16.rows if "batch" in row.spec)
    assert gathered > 0 and terms["gathered_weights"] == gathered
    # Each gathered bfloat16 element grows by two bytes in its float32 copy.
    assert terms["gathered_float32"] == gathered
    assert terms["weights_float32"] == 2 * bf16.max_device_bytes
    f32 = keras_hub_autodist.plan(preset, mesh, strategy="fsdp")
    assert step_memory.activation_terms(f32, 2, 64)["gathered_float32"] == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0, sequence_length=8), r"Received: batch_size=0"),
        (dict(batch_size=2, sequence_length=2.5), r"Received: sequence_length=2.5"),
    ],
)
def test_bad_sizes_are_refused(kwargs, match):
    with pytest.raises(PlanError, match=match):
        _plan({"batch": 2, "model": 4}).activation_bytes_per_device(**kwargs)


def test_mixtral_by_hand():
    # mixtral_8x7b: 32 blocks, d=4096, 32 query and 8 kv heads of 128, 8
    # experts with gate and up of 14336 each, every expert run on every token
    # (keras-hub's batched MoE), untied vocab 32000. Mesh 2 x 8: the experts
    # go over 'model' (expert parallelism), heads and vocab split 8 ways,
    # K/V 8 ways.
    plan = _plan({"batch": 2, "model": 8}, preset="mixtral_8x7b")
    b, s = 8 / 2, 128
    block = (
        4 * b * s * 4096
        + 2 * b * s * 32 * 128 / 8
        + 2 * b * s * 8 * 128 / 8
        + 1.5 * b * 32 * s * s / 8
        + b * s * s
    )
    one_block = 2 * b * 32 * s * s / 8
    experts = 2 * (2 * b * s * 14336 * 8 / 8) + b * s * 4096 * 8 / 8
    head = 2 * b * s * 4096 + 3 * b * s * 32000 / 8
    # XLA's CPU backend keeps each float32 expert up-projection kernel (gate
    # and up, one expert per device) again in its batched matmul's layout.
    relayout = 32 * 2 * 1 * 4096 * 14336
    expected = int((32 * (block + experts) + one_block + head + relayout) * 4)
    assert plan.activation_bytes_per_device(8, 128) == expected
    terms = step_memory.activation_terms(plan, 8, 128)
    assert terms["experts_relayout"] == relayout * 4
    assert step_memory.ACTIVATION_FACTORS["gpu"]["experts_relayout"] == 0


def test_fsdp_keeps_no_gathered_copy_of_the_experts():
    fsdp = _plan({"batch": 2, "model": 8}, strategy="fsdp", preset="mixtral_8x7b")
    experts = [r for r in fsdp.rows if "expert" in r.logical_axes]
    assert any("batch" in r.spec for r in experts)
    others = sum(
        r.device_bytes
        for r in fsdp.rows
        if "batch" in r.spec and "expert" not in r.logical_axes
    )
    terms = step_memory.activation_terms(fsdp, 8, 128)
    assert terms["gathered_weights"] == others
