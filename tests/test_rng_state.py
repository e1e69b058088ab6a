"""RNG state (dropout's seed generators) is replicated non-weight state: a
preset with dropout plans and loads in every family, and `remat="full"`
threads that state through each recomputed block."""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import batch_for

import keras_hub_autodist
from keras_hub_autodist.planning.remat import non_weight_state

MESH = {"batch": 2, "model": 4}

# family -> (backbone class, config): every family keras_hub_autodist plans.
FAMILIES = {
    "gemma": (keras_hub.models.GemmaBackbone, tiny_presets.GEMMA_MQA),
    "gemma2": (keras_hub.models.GemmaBackbone, tiny_presets.GEMMA2_GQA),
    "gemma3": (keras_hub.models.Gemma3Backbone, tiny_presets.GEMMA3_TEXT),
    "llama3": (keras_hub.models.Llama3Backbone, tiny_presets.LLAMA3),
    **{
        name: (backbone, config)
        for name, (backbone, _, config) in {
            **tiny_presets.DENSE_FAMILIES,
            **tiny_presets.MOE_FAMILIES,
        }.items()
    },
}


def with_dropout(backbone_class, config):
    """`config` with every dropout rate its backbone takes set to 0.1."""
    import inspect

    taken = inspect.signature(backbone_class.__init__).parameters
    rates = {name: 0.1 for name in taken if name.endswith("dropout")}
    assert rates, backbone_class
    return {**config, **rates}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_backbone_with_dropout_is_planned_without_its_rng_state(family):
    backbone_class, config = FAMILIES[family]
    config = with_dropout(backbone_class, config)
    model = backbone_class(**config)
    # keras-hub 0.32's SmolLM3 keeps `attention_dropout` without a layer.
    assert bool(non_weight_state(model)) == (family != "smollm3")
    plan = keras_hub_autodist.plan(
        {"class_name": backbone_class, "config": config}, MESH
    )
    # Paths of auto-named layers differ from build to build: count them.
    assert len(plan.rows) == len(model.weights)
    assert not any("seed_generator" in row.path for row in plan.rows)


@pytest.fixture(scope="module")
def dropout_preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("dropout") / "gemma",
        keras_hub.models.GemmaBackbone,
        {**tiny_presets.GEMMA_MQA, "dropout": 0.3},
        task_class=keras_hub.models.GemmaCausalLM,
    )


def trained(preset, remat, epochs=2):
    """A mesh load of `preset` fitted `epochs` epochs, from the same seed
    generator states whatever `remat` is."""
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
    history = lm.fit(x, y, batch_size=len(y), epochs=epochs, verbose=0)
    return lm, history.history["loss"]


@pytest.fixture(scope="module")
def trained_without_remat(dropout_preset):
    return trained(dropout_preset, None)


def test_a_preset_with_dropout_loads_and_trains_on_a_mesh(
    dropout_preset, trained_without_remat
):
    lm, losses = trained_without_remat
    plain = keras_hub.models.CausalLM.from_preset(dropout_preset, preprocessor=None)
    for loaded, reference in zip(lm.backbone.weights, plain.backbone.weights):
        assert loaded.path == reference.path
    assert all(np.isfinite(losses))
    states = non_weight_state(lm.backbone)
    assert all(state.value.sharding.is_fully_replicated for state in states)
    # Advanced by the training steps (from the [index + 7, 0] set above).
    assert any(int(state.value[1]) > 0 for state in states)


def test_full_remat_with_dropout_trains_as_without(
    dropout_preset, trained_without_remat
):
    plain, plain_losses = trained_without_remat
    lm, losses = trained(dropout_preset, "full")
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for variable, reference in zip(lm.backbone.variables, plain.backbone.variables):
        np.testing.assert_allclose(
            np.asarray(variable.value), np.asarray(reference.value), atol=1e-6
        )
    # The dropout masks differ from step to step: training mode draws.
    assert plain_losses[0] != plain_losses[1]
