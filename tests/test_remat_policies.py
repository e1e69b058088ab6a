"""The block policies of `remat=` beyond `"full"`
(`remat_arguments.BLOCK_POLICIES`): each trains as no remat does, on a mesh
and on one device, dropout included; each keeps what it says, in the
compiled step and in the closed form; a name that is none of them is
refused with the list of those that are."""

import jax
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import assert_same_training
from equivalence import batch_for

import keras_hub_autodist
from keras_hub_autodist import PlanError
from keras_hub_autodist.fitting import remat_memory
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.planning.remat import non_weight_state
from keras_hub_autodist.planning.remat import recomputed_in_backward
from keras_hub_autodist.planning.remat_arguments import BLOCK_POLICIES
from keras_hub_autodist.planning.remat_arguments import check_remat
from keras_hub_autodist.searching import cache
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

MESH = {"batch": 2, "model": 4}
# The policies this file checks: every block policy but `"full"`
# (tests/test_remat.py and tests/test_rng_state.py check that one).
POLICIES = [name for name in BLOCK_POLICIES if name != "full"]
# A Gemma-like and a Llama-like CausalLM, each with dropout.
FAMILIES = {
    "gemma": (
        keras_hub.models.GemmaBackbone,
        keras_hub.models.GemmaCausalLM,
        {**tiny_presets.GEMMA_MQA, "dropout": 0.3},
    ),
    "llama": (
        keras_hub.models.Llama3Backbone,
        keras_hub.models.Llama3CausalLM,
        {**tiny_presets.LLAMA3, "dropout": 0.3},
    ),
}


@pytest.fixture(scope="module")
def dropout_presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    return {
        name: tiny_presets.save_preset(root / name, backbone, config, task_class=task)
        for name, (backbone, task, config) in FAMILIES.items()
    }


def trained(preset, remat, steps=2):
    """A mesh load of `preset` trained `steps` steps of SGD, from the same
    seed generator states whatever `remat` is."""
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH, remat=remat
    )
    for index, variable in enumerate(non_weight_state(lm.backbone)):
        variable.assign(np.array([index + 7, 0], variable.dtype))
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch_for(preset, sequence_length=16)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(steps)
    ]
    return lm, losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_with_dropout_trains_as_without_remat(dropout_presets, family, policy):
    preset = dropout_presets[family]
    plain, plain_losses = trained(preset, None)
    lm, losses = trained(preset, policy)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for variable, reference in zip(lm.backbone.variables, plain.backbone.variables):
        np.testing.assert_allclose(
            np.asarray(variable.value), np.asarray(reference.value), atol=1e-6
        )
    # The dropout masks differ from step to step: training mode draws.
    assert plain_losses[0] != plain_losses[1]


@pytest.mark.parametrize("name", ["gemma_mqa", "llama3_untied"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_trains_as_one_device_does_on_a_mesh_and_off(
    tiny_presets_dir, name, policy
):
    preset = tiny_presets_dir[name]
    one_device = keras.distribution.DeviceMesh(
        (1, 1), ("batch", "model"), jax.devices()[:1]
    )
    for mesh in (MESH, one_device):
        assert_same_training(preset, "sgd", device_mesh=mesh, remat=policy)


def test_the_policy_path_gives_the_gradients_of_the_function():
    """`recomputed_in_backward` with a `jax.checkpoint` policy: the
    function's value and gradients, under `jit`, on the CPU."""
    weights = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def block(x, w):
        return x + jax.nn.gelu(jax.nn.softmax(x @ w) @ w.T)

    def loss(weights, x, policy):
        for w in weights:
            if policy is None:
                x = block(x, w)
            else:
                x = recomputed_in_backward(block, x, w, policy=policy)
        return (x**2).sum()

    expected = jax.value_and_grad(loss)(weights, x, None)
    saving = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    got = jax.jit(jax.value_and_grad(loss), static_argnums=2)(weights, x, saving)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


# A tiny Gemma of 8 blocks whose weight matmuls' outputs are large beside
# its scores (4 query heads of 32, a hidden size of 256, an MLP of 1024).
DOTS_HEAVY = dict(
    vocabulary_size=256,
    num_layers=8,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=256,
    intermediate_dim=1024,
    head_dim=32,
)


@pytest.fixture(scope="module")
def dots_heavy(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("dots_heavy") / "gemma",
        keras_hub.models.GemmaBackbone,
        DOTS_HEAVY,
        task_class=keras_hub.models.GemmaCausalLM,
    )


def test_dots_keeps_more_than_full_and_less_than_nothing_compiled_and_closed(
    dots_heavy,
):
    """The step compiled for this machine's CPU, and the closed form: each
    block kept whole without remat, its input alone with `"full"`, and its
    input and matmuls' outputs with `"dots"`, in between."""
    one_device = {"batch": 1, "model": 1}
    compiled, closed = {}, {}
    for remat in (None, "full", "dots"):
        plan = keras_hub_autodist.plan(dots_heavy, one_device, remat=remat)
        compiled[remat] = keras_hub_autodist.compiled_memory(
            plan, 2, 256, "sgd"
        ).peak_bytes
        closed[remat] = step_memory.step_estimate(
            plan, 2, 256, "sgd", platform="cpu"
        ).total_bytes
    for peaks in (compiled, closed):
        assert peaks["full"] < peaks["dots"] < peaks[None], (compiled, closed)
    # What "dots" keeps beyond "full": the blocks' matmul outputs, in
    # float32 on the CPU. The closed form counts them all, and one block's
    # recomputation as "full"'s less them: XLA's CPU backend holds less
    # for that block here (1.3x).
    kept = compiled["dots"] - compiled["full"]
    counted = closed["dots"] - closed["full"]
    assert kept <= counted <= 1.5 * kept, (kept, counted)


# Backbones whose one decoder block is traced under JAX's policy: (class,
# config, the block's padding-mask argument, LoRA rank).
SAVING_BLOCKS = {
    "gemma": (keras_hub.models.GemmaBackbone, tiny_presets.GEMMA_MQA, None),
    "gemma_lora": (keras_hub.models.GemmaBackbone, tiny_presets.GEMMA_MQA, 4),
    # Norms after the output and down projections: the down one is kept.
    "gemma2": (keras_hub.models.GemmaBackbone, tiny_presets.GEMMA2_GQA, None),
    "gemma3": (keras_hub.models.Gemma3Backbone, tiny_presets.GEMMA3_TEXT, None),
    "llama": (keras_hub.models.Llama3Backbone, tiny_presets.LLAMA3, None),
    "mixtral": (keras_hub.models.MixtralBackbone, tiny_presets.MIXTRAL, None),
}


def saved_dots_of_one_block(backbone, rows, tokens):
    """Elements of the matmul outputs `jax.checkpoint` saves of `backbone`'s
    first decoder block under `"dots"`'s policy, on `rows` sequences of
    `tokens`, as `jax.ad_checkpoint.print_saved_residuals` lists them."""
    import contextlib
    import inspect
    import io
    import math
    import re

    block = backbone.transformer_layers[0]
    x = jax.numpy.ones((rows, tokens, backbone.hidden_dim))
    mask = jax.numpy.ones((rows, tokens), "int32")
    argument = (
        "decoder_padding_mask"
        if "decoder_padding_mask" in inspect.signature(block.call).parameters
        else "padding_mask"
    )
    weights = [v.value for v in block.trainable_variables]
    others = [v.value for v in block.non_trainable_variables]

    def call(weights, x):
        outputs = block.stateless_call(weights, others, x, **{argument: mask})[0]
        return outputs[0] if isinstance(outputs, tuple) else outputs

    policy = getattr(jax.checkpoint_policies, BLOCK_POLICIES["dots"].saveable)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(
            jax.checkpoint(call, policy=policy), weights, x
        )
    shapes = re.findall(r"\w+\[([\d,]+)\] output of dot_general", printed.getvalue())
    return sum(math.prod(map(int, shape.split(","))) for shape in shapes)


@pytest.mark.parametrize("name", sorted(SAVING_BLOCKS))
def test_the_closed_form_counts_what_the_policy_saves_of_a_block(name):
    """`saved_dot_elements` against JAX's own list of what the policy
    saves: within 3%, the rotary embedding's small position matmuls and a
    mixture's router the only outputs it leaves out."""
    backbone_class, config, lora_rank = SAVING_BLOCKS[name]
    backbone = backbone_class(**config)
    if lora_rank:
        backbone.enable_lora(lora_rank)
    saved = saved_dots_of_one_block(backbone, 2, 16)
    plan = keras_hub_autodist.plan(
        {"class_name": backbone_class, "config": config},
        {"batch": 1},
        lora_rank=lora_rank,
    )
    counted = remat_memory.saved_dot_elements(plan, 2, 16) / config["num_layers"]
    assert counted <= saved <= 1.03 * counted, (saved, counted)


@pytest.mark.parametrize("name", ["offload_dots", "offload", "block_inputs", "most"])
def test_a_name_that_is_no_policy_is_refused_with_the_policies(name):
    with pytest.raises(PlanError) as raised:
        check_remat(name)
    message = str(raised.value)
    assert f"Received: remat={name!r}" in message
    for policy, rule in BLOCK_POLICIES.items():
        assert f"{policy!r} (each decoder block keeps {rule.keeps})" in message


def test_the_step_cost_counts_no_matmul_again_under_dots(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], MESH)
    passes = {remat: step_cost.passes(None, remat) for remat in (None, "full", "dots")}
    assert passes == {None: 3, "full": 4, "dots": 3}
    flops = {
        remat: step_cost.model_flops(plan, 8, 512, None, remat)
        for remat in (None, "full", "dots")
    }
    # Attention is computed again under every policy; the matmuls only
    # under "full".
    assert flops[None] < flops["dots"] < flops["full"]


def test_each_policy_is_its_own_compiled_step(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], MESH)
    keys = {
        cache.step_key(
            CompiledStepInputs(
                plan=plan.replace(remat=remat),
                config={},
                batch_size=4,
                sequence_length=32,
                optimizer="adam",
                device="v5e",
            )
        )
        for remat in (None, *BLOCK_POLICIES)
    }
    assert len(keys) == 1 + len(BLOCK_POLICIES)
