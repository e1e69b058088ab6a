"""Context parallelism on every family: training, `predict`, `generate`,
saving and the compiled memory (tests/test_context_parallel.py checks the
plans and trains one case).

Training equals one device's (losses to rtol 1e-5, SGD weights to 1e-5),
`predict` gives its logits (atol 1e-4), and the train step's token ids are
split on the sequence over the context axis. Sequences of 16 tokens make 4
blocks of 4 on a context axis of 4, so causal masks, Gemma 3's sliding
window (4 tokens) and RoPE positions all cross block boundaries.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import assert_same_generate
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import mesh_id
from test_context_parallel import assert_estimate_near_the_compiled_step

import keras_hub_autodist
from keras_hub_autodist import SequenceLengthError

pytestmark = pytest.mark.slow

SEQUENCE = 16
MESHES = [
    {"batch": 2, "context": 4},
    {"batch": 1, "context": 4, "model": 2},
]
# Gemma (one key/value head), Llama 3 (grouped heads, untied embeddings) and
# Gemma 3 (sliding window, local/global layers, query/key norms).
CAUSAL_LMS = ["gemma_mqa", "llama3_untied", "gemma3_text"]
# Every other family, MoE included, on the mesh with all three roles:
# preset name -> its CausalLM class.
FAMILIES = {
    **{name: spec[1] for name, spec in tiny_presets.DENSE_FAMILIES.items()},
    **{
        tiny_presets.moe_preset_name(family, 8): spec[1]
        for family, spec in tiny_presets.MOE_FAMILIES.items()
    },
}


def token_ids_specs(lm, batch):
    """The layouts of the token ids the train step gets, one per batch."""
    seen = []
    step = lm.train_function

    def recording(state, batches):
        batches = list(batches)
        seen.extend(tuple(x["token_ids"].sharding.spec) for x, *_ in batches)
        return step(state, iter(batches))

    lm.train_function = recording
    try:
        lm.train_on_batch(*batch)
    finally:
        lm.train_function = step
    return seen


def single_device_logits(preset, x, task=keras_hub.models.CausalLM):
    lm = task.from_preset(preset, preprocessor=None)
    return np.asarray(lm.predict(x, verbose=0))


def assert_context_parallel_matches(preset, mesh, task=keras_hub.models.CausalLM):
    gemma4 = "gemma4" in preset
    batch = batch_for(preset, sequence_length=SEQUENCE, position_ids=gemma4)
    logits_before = single_device_logits(preset, batch[0], task)
    lm = task.from_preset(preset, preprocessor=None, device_mesh=mesh)
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), logits_before, atol=1e-4
    )
    lm = assert_same_training(preset, task=task, batch=batch, device_mesh=mesh)
    assert token_ids_specs(lm, batch) == [("batch", "context")]
    return lm


@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_training_and_predict_match_one_device(tiny_presets_dir, name, mesh):
    assert_context_parallel_matches(tiny_presets_dir[name], mesh)


@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_gemma3_with_a_window_of_8_on_blocks_of_8(tmp_path, mesh):
    """32 tokens in blocks of 8: each block's window reaches into the one
    before it, never further."""
    config = {**tiny_presets.GEMMA3_TEXT, "sliding_window_size": 8}
    preset = tiny_presets.gemma3_preset(tmp_path / "gemma3_window_8", config=config)
    batch = batch_for(preset, sequence_length=32)
    logits = single_device_logits(preset, batch[0])
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), logits, atol=1e-4
    )
    assert_same_training(preset, batch=batch, device_mesh=mesh)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_matches_one_device(tiny_presets_dir, name):
    assert_context_parallel_matches(tiny_presets_dir[name], MESHES[1], FAMILIES[name])


def test_fsdp_over_batch_and_context_matches_one_device(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    batch = batch_for(preset, sequence_length=SEQUENCE)
    lm = assert_same_training(
        preset, batch=batch, device_mesh={"batch": 2, "context": 4}, strategy="fsdp"
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert any("context" in row.spec for row in plan.rows)


# A family of each attention reading (`compat.attention`): with a cache
# each replaced layer takes its own path, prompt and decoding alike.
GENERATING = [
    "gemma_mqa",
    "llama3_untied",
    "qwen2",
    "qwen3",
    "phi3",
    "smollm3",
    tiny_presets.moe_preset_name("mixtral", 8),
    tiny_presets.moe_preset_name("qwen_moe", 8),
    tiny_presets.moe_preset_name("qwen3_moe", 8),
    "gemma4",
]


@pytest.mark.parametrize("name", GENERATING)
def test_generate_gives_the_tokens_of_one_device(tiny_presets_dir, name):
    # Gemma 4's CausalLM named: `CausalLM.from_preset` may pick its assistant.
    task = (
        tiny_presets.DENSE_FAMILIES["gemma4"][1]
        if name.startswith("gemma4")
        else keras_hub.models.CausalLM
    )
    assert_same_generate(tiny_presets_dir[name], MESHES[1], task=task)


def test_a_sequence_the_axis_does_not_divide_is_refused_before_compute(
    tiny_presets_dir,
):
    preset = tiny_presets_dir["gemma_mqa"]
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESHES[0]
    )
    lm.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    before = [np.asarray(w.value) for w in lm.weights]
    with pytest.raises(SequenceLengthError, match=r"a multiple of 4.*\(8, 6\)"):
        lm.train_on_batch(*batch_for(preset, sequence_length=6))
    for weight, value in zip(lm.weights, before):
        np.testing.assert_array_equal(np.asarray(weight.value), value)


def test_a_preset_saved_from_a_context_mesh_reloads_anywhere(
    tiny_presets_dir, tmp_path
):
    preset = tiny_presets_dir["llama3_untied"]
    batch = batch_for(preset, sequence_length=SEQUENCE)
    lm = assert_same_training(preset, batch=batch, device_mesh=MESHES[1])
    lm.save_to_preset(str(tmp_path / "saved"))
    trained = np.asarray(lm.predict(batch[0], verbose=0))
    for mesh in ({"batch": 2, "model": 4}, None):
        kwargs = {"device_mesh": mesh} if mesh else {}
        again = keras_hub.models.CausalLM.from_preset(
            str(tmp_path / "saved"), preprocessor=None, **kwargs
        )
        np.testing.assert_allclose(
            np.asarray(again.predict(batch[0], verbose=0)), trained, atol=1e-4
        )


def test_compiled_peak_at_4096_tokens_on_8_devices(tiny_presets_dir):
    """Tiny weights, so the peak is the sequence: XLA's compiled peak per
    device of the training step at 1 x 4096 tokens, context=8 against one
    device, at most 0.30x."""
    preset = tiny_presets_dir["gemma_mqa"]
    peaks = {}
    for mesh in ({"batch": 1}, {"batch": 1, "context": 8}):
        plan = keras_hub_autodist.plan(preset, mesh)
        memory = keras_hub_autodist.compiled_memory(plan, 1, 4096, "sgd")
        peaks[len(mesh)] = memory.peak_bytes
    assert peaks[2] <= 0.30 * peaks[1], peaks
    assert keras.distribution.distribution() is None


# Mistral with grouped heads and a sliding window of 4 tokens, which its
# decoder blocks put in the mask itself.
MISTRAL = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    sliding_window=4,
)


def padded_batch(preset):
    """Row 0 left-padded (its first 3 tokens), row 1 right-padded (its last
    5), the others whole."""
    x, y = batch_for(preset, sequence_length=SEQUENCE)
    x["padding_mask"][0, :3] = 0
    x["padding_mask"][1, -5:] = 0
    return x, y


@pytest.fixture(scope="module")
def mistral_preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("mistral") / "mistral",
        keras_hub.models.MistralBackbone,
        MISTRAL,
        task_class=keras_hub.models.MistralCausalLM,
    )


# Each family and mesh with the default strategy; the ring on the families
# with windows and local/global layers, on both meshes.
PADDED_CASES = [
    (name, mesh, "all_gather") for name in CAUSAL_LMS + ["mistral"] for mesh in MESHES
] + [(name, mesh, "ring") for name in ("gemma3_text", "mistral") for mesh in MESHES]


@pytest.mark.parametrize(
    "name,mesh,strategy",
    PADDED_CASES,
    ids=[f"{n}-{mesh_id(m)}-{s}" for n, m, s in PADDED_CASES],
)
def test_padded_batches_match_one_device(
    tiny_presets_dir, mistral_preset, name, mesh, strategy
):
    """Left- and right-padded rows: logits to rtol 1e-5 / atol 1e-4, losses
    and SGD weights as one device's."""
    preset = mistral_preset if name == "mistral" else tiny_presets_dir[name]
    batch = padded_batch(preset)
    logits = single_device_logits(preset, batch[0])
    options = dict(device_mesh=mesh, context_parallel_strategy=strategy)
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **options)
    np.testing.assert_allclose(
        np.asarray(lm.predict(batch[0], verbose=0)), logits, rtol=1e-5, atol=1e-4
    )
    assert_same_training(preset, batch=batch, **options)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_compiled_peak_is_linear_in_the_sequence(tmp_path, strategy):
    """A Gemma-shaped model (4 query heads, 1 key/value head, head_dim 64,
    hidden 256, 2 layers) on context=8, batch 1: from 8k to 64k tokens each
    doubling of the sequence costs at most 2.2x the compiled peak per
    device (the whole score matrix would cost 4x)."""
    path = tiny_presets.save_preset(
        tmp_path / "gemma_shaped",
        keras_hub.models.GemmaBackbone,
        tiny_presets.GEMMA_SHAPED,
    )
    plan = keras_hub_autodist.plan(
        path, {"batch": 1, "context": 8}, context_parallel_strategy=strategy
    )
    peaks = [
        keras_hub_autodist.compiled_memory(plan, 1, tokens, "sgd").peak_bytes
        for tokens in (8192, 16384, 32768, 65536)
    ]
    ratios = [after / before for before, after in zip(peaks, peaks[1:])]
    assert max(ratios) <= 2.2, (peaks, ratios)


# Measured off by more than 15% on `{"batch": 1, "context": 4, "model": 2}`
# at 8192 tokens (estimate / compiled): Qwen 2 1.16 and Qwen-MoE 1.17 (the
# activations of every family there are counted 10-20% over, Qwen 3's
# query/key norms, which no term counts, make up some of it); Gemma 4 with
# its mixture of experts 0.82 (as on one device, 0.78 at 2048 tokens: the
# estimate counts about a third of what its MoE block keeps).
OFF_ON_A_MODEL_AXIS = {"qwen2": "1.16x", "qwen_moe": "1.17x", "gemma4_moe": "0.82x"}
ESTIMATE_CASES = [
    pytest.param(family, mesh, length, id=f"{family}-{name}")
    for family in sorted({**tiny_presets.DENSE_FAMILIES, **tiny_presets.MOE_FAMILIES})
    for name, mesh, length in [
        ("context8-4k", {"batch": 1, "context": 8}, 4096),
        ("context8-16k", {"batch": 1, "context": 8}, 16384),
    ]
] + [
    pytest.param(
        family,
        {"batch": 1, "context": 4, "model": 2},
        8192,
        id=f"{family}-context4-model2-8k",
        marks=[pytest.mark.xfail(reason=f"measured {OFF_ON_A_MODEL_AXIS[family]}")]
        if family in OFF_ON_A_MODEL_AXIS
        else [],
    )
    for family in sorted({**tiny_presets.DENSE_FAMILIES, **tiny_presets.MOE_FAMILIES})
]


@pytest.mark.parametrize("family,mesh,sequence_length", ESTIMATE_CASES)
def test_the_estimate_is_near_the_compiled_step(family, mesh, sequence_length):
    """Every family's closed-form CPU estimate within 15% of the compiled
    step on a context mesh, where its attention holds one block of keys'
    scores per device."""
    assert_estimate_near_the_compiled_step(family, mesh, sequence_length)
