"""A bound causal LM's loss, taken a chunk of tokens at a time, against the
same model's whole-logits loss on one device: the loss, the accuracy, the
weights after training, `evaluate` and `predict`, on batch, model, context
and padded meshes, with Gemma 2's soft-capped logits and LoRA; and the
compiled step's memory, which no longer holds the whole vocabulary's
float32 logits."""

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.errors import WholeLogitsWarning
from keras_hub_autodist.loss import chunked_cross_entropy as chunked
from keras_hub_autodist.loss import chunked_steps
from keras_hub_autodist.loss import chunks as chunk_rule

SEQUENCE = 16


@pytest.fixture
def chunk_calls(monkeypatch):
    """The chunk counts every chunked loss was traced with."""
    calls = []
    original = chunked_steps.chunked_cross_entropy

    def counting(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(chunked_steps, "chunked_cross_entropy", counting)
    return calls


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_chunks_match_whole_logits_in_value_and_gradient(reduction):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 12, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 12)), jnp.int32)
    # Sample weights with padded tokens (0) and weights of the user's own.
    weights = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], (2, 12)), jnp.float32)

    def head(kernel, states):
        return jnp.tanh(states @ kernel / 5.0) * 5.0

    def reduce(entropy):  # as a Keras loss reduces per-token values
        total = jnp.sum(entropy * weights)
        return total / jnp.sum(weights) if reduction != "sum" else total

    def whole(hidden, kernel):
        logits = head(kernel, hidden)
        entropy = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, labels[..., None], -1
        ).squeeze(-1)
        return entropy, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)

    def trained(hidden, kernel, chunks):
        return chunked.chunked_cross_entropy(
            head, kernel, hidden, labels, weights, chunks
        )

    def frozen(hidden, kernel, chunks):
        return chunked.chunked_cross_entropy(
            lambda _, states: head(kernel, states), (), hidden, labels, weights, chunks
        )

    expected, expected_matches = whole(hidden, kernel)
    expected_grads = jax.grad(lambda h, k: reduce(whole(h, k)[0]), (0, 1))(
        hidden, kernel
    )
    for chunks in (1, 3, 4, 12):
        for in_chunks in (trained, frozen):
            entropy, matches = in_chunks(hidden, kernel, chunks)
            np.testing.assert_allclose(entropy, expected, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(matches, expected_matches)
        grads = jax.grad(
            lambda h, k, chunks=chunks: reduce(trained(h, k, chunks)[0]), (0, 1)
        )(hidden, kernel)
        for got, want in zip(grads, expected_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # A frozen head's states take any cotangent, token by token.
        cotangent = jnp.asarray(rng.normal(size=(2, 12)), jnp.float32)
        got = jax.grad(
            lambda h, chunks=chunks, c=cotangent: jnp.sum(
                frozen(h, kernel, chunks)[0] * c
            )
        )(hidden)
        want = jax.grad(lambda h, c=cotangent: jnp.sum(whole(h, kernel)[0] * c))(hidden)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="Received: chunks=5, sequence=12"):
        trained(hidden, kernel, 5)


def test_chunk_counts_divide_each_part_of_a_split_sequence():
    gib, mib = 2**30, 2**20
    count = chunk_rule.chunk_count
    # A large head (Gemma 3 1B's, 0.6 GiB): Keras' own step up to 4 GiB of
    # float32 logits a device, then chunks of 512 tokens (512 MiB of
    # Gemma's logits, more than the 256 MiB floor), each dividing a
    # device's part of the sequence; past 16 GiB, chunks of 256 MiB.
    head = {"head_bytes": 600 * mib}
    assert count(1, 32768, 262144, **head) == 128
    assert count(1, 16384, 262144, **head) == 32
    assert count(1, 32768, 262144, splits=4, **head) == 16
    assert count(1, 8192, 262144, **head) == 16
    assert count(1, 4096, 262144, **head) == 1
    # Gemma 2B's 8 x 1024 tokens: 16 chunks of 512 tokens (8 of each row).
    assert count(8, 1024, 256000, head_bytes=gib) == 16
    # A smaller vocabulary's chunks hold 256 MiB of logits, more tokens.
    assert count(1, 8192, 32768, head_bytes=600 * mib) == 1
    assert count(2, 32768, 32768, head_bytes=600 * mib) == 32
    # A head of 64 MiB may be read four times more.
    assert count(1, 4096, 262144, head_bytes=64 * mib) == 4
    # A trained head of 0.5 GiB (Llama 3.2 1B's): chunks of up to 1 GiB
    # beyond 4 GiB, as its gradient costs that much anyway.
    trained = {"head_bytes": gib // 2, "trained_head_bytes": gib // 2}
    assert count(2, 1024, 128256, **trained) == 1
    assert count(16, 1024, 128256, **trained) == 8
    # A small head is cheap to read again: at least 32 chunks.
    assert count(4, 256, 32768, head_bytes=4 * mib, trained_head_bytes=4 * mib) == 32
    assert count(8, 16, 1000, head_bytes=mib) == 16
    # ... off a context axis, which already splits each device's logits.
    assert count(4, 256, 32768, splits=2, head_bytes=mib) == 1
    # A prime length can only be cut token by token.
    assert count(64, 4099, 262144, **head) == 4099


def _batch(vocabulary, rows=8, padded=4, side="right"):
    """Token ids, their labels and padding masks, with `padded` tokens of
    padding at the `side` of each row (keras-hub pads at the right; a
    generation prompt is padded at the left)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (rows, SEQUENCE)).astype("int32")
    padding = np.ones_like(ids)
    if side == "right":
        padding[:, SEQUENCE - padded :] = 0
    else:
        padding[:, :padded] = 0
    x = {"token_ids": ids, "padding_mask": padding}
    return x, np.roll(ids, -1, axis=1), padding.astype("float32")


def _train(
    path,
    task_class,
    device_mesh=None,
    lora=False,
    rows=8,
    compile_args=(),
    strategy="tp",
    side="right",
):
    kwargs = {} if device_mesh is None else {"device_mesh": device_mesh}
    if device_mesh is not None:
        kwargs["strategy"] = strategy
    lm = task_class.from_preset(path, preprocessor=None, **kwargs)
    if lora:
        keras.utils.set_random_seed(0)  # the same LoRA kernels in both runs
        lm.backbone.enable_lora(2)
    # Adam's epsilon above the gradients' rounding: a gradient near zero,
    # summed in another order on a mesh, would otherwise step by up to the
    # whole learning rate either way.
    optimizer = keras.optimizers.Adam(1e-2, epsilon=1e-4)
    lm.compile(optimizer=optimizer, **dict(compile_args))
    x, y, weights = _batch(lm.backbone.vocabulary_size, rows, side=side)
    logs = [lm.train_on_batch(x, y, weights, return_dict=True) for _ in range(2)]
    logs.append(lm.evaluate(x, y, sample_weight=weights, return_dict=True, verbose=0))
    return lm, logs, lm.predict(x, verbose=0)


def _assert_same(ours, reference):
    lm, logs, logits = ours
    lm_ref, logs_ref, logits_ref = reference
    for got, want in zip(logs, logs_ref):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6)
    # `predict` keeps whole logits.
    assert logits.shape == logits_ref.shape
    np.testing.assert_allclose(logits, logits_ref, rtol=1e-4, atol=1e-4)
    for weight, weight_ref in zip(lm.trainable_weights, lm_ref.trainable_weights):
        np.testing.assert_allclose(
            np.asarray(weight.value), np.asarray(weight_ref.value), atol=2e-5
        )


# name: (preset, mesh, LoRA, rows, strategy, padded side)
CASES = {
    # Gemma: tied embeddings, on one device.
    "gemma-one-device": ("gemma_mqa", "one device", False, 8, "tp", "right"),
    # Gemma 2: soft-capped logits, vocabulary over the model axis.
    "gemma2-batch2-model4": (
        "gemma2_gqa",
        {"batch": 2, "model": 4},
        False,
        8,
        "tp",
        "left",
    ),
    "gemma2-lora-model8": (
        "gemma2_gqa",
        {"batch": 1, "model": 8},
        True,
        8,
        "tp",
        "right",
    ),
    # Llama 3 with its own output embedding; 6 rows padded to the batch axis.
    "llama-untied-batch4-model2-padded": (
        "llama3_untied",
        {"batch": 4, "model": 2},
        False,
        6,
        "tp",
        "right",
    ),
    # Qwen 3, its weights sharded over the batch axis too.
    "qwen3-fsdp-batch2-model4": (
        "qwen3",
        {"batch": 2, "model": 4},
        False,
        8,
        "fsdp",
        "left",
    ),
    # Mixtral's experts.
    "mixtral-batch2-model4": (
        tiny_presets.moe_preset_name("mixtral", 8),
        {"batch": 2, "model": 4},
        False,
        8,
        "tp",
        "right",
    ),
    # Each sequence split over a context axis of 2.
    "gemma3-context2": (
        "gemma3_text",
        {"batch": 2, "context": 2, "model": 2},
        False,
        8,
        "tp",
        "right",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_bound_causal_lm_takes_its_loss_in_chunks_as_one_device_does(
    case, tiny_presets_dir, chunk_calls, monkeypatch
):
    name, mesh, lora, rows, strategy, side = CASES[case]
    if "context" in str(mesh):  # cut where the rule keeps whole logits
        monkeypatch.setattr(chunked_steps, "chunk_count", lambda *_: 4)
    if mesh == "one device":
        devices = keras.distribution.list_devices()[:1]
        mesh = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), devices)
    path = tiny_presets_dir[name]
    task_class = keras_hub.models.CausalLM
    reference = _train(path, task_class, lora=lora, rows=rows, side=side)
    assert chunk_calls == []  # an unbound model keeps Keras' own step
    ours = _train(path, task_class, mesh, lora, rows, strategy=strategy, side=side)
    # The training step and the evaluation step, each in several chunks.
    assert len(chunk_calls) == 2 and min(chunk_calls) > 1
    _assert_same(ours, reference)


def test_a_loss_or_metric_that_needs_whole_logits_keeps_them_and_says_why(
    tiny_presets_dir, chunk_calls
):
    path = tiny_presets_dir["gemma_mqa"]
    compile_args = {
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "weighted_metrics": [keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
    }
    task_class = keras_hub.models.CausalLM
    reference = _train(path, task_class, compile_args=compile_args)
    with pytest.warns(WholeLogitsWarning, match="SparseTopKCategoricalAccuracy"):
        ours = _train(path, task_class, {"batch": 8}, compile_args=compile_args)
    assert chunk_calls == []
    _assert_same(ours, reference)


def test_the_warning_names_a_loss_of_the_users_own(tiny_presets_dir):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh={"batch": 8}
    )
    lm.compile(loss="mse", optimizer="sgd")
    assert "its compiled loss is 'mse'" in chunked_steps.why_whole_logits(
        lm, np.zeros((8, SEQUENCE))
    )


def test_a_head_that_drops_tokens_is_left_as_it_is():
    inputs = keras.Input((None, 4))
    hidden = keras.layers.Dense(4)(inputs)
    dropped = keras.layers.Lambda(lambda h: h[:, 1:])(hidden)

    class Task(keras.Model):
        pass

    backbone = keras.Model(inputs, hidden)
    task = Task(inputs, keras.layers.Dense(7)(dropped))
    object.__setattr__(task, "backbone", backbone)
    assert not chunked_steps.install_chunked_loss(task)


@pytest.mark.parametrize(
    "mesh", [{"batch": 1}, {"batch": 2, "model": 4}, {"batch": 1, "model": 8}]
)
def test_the_compiled_step_holds_a_fraction_of_its_share_of_the_logits(
    mesh, monkeypatch
):
    # A 32k vocabulary over a short model, its embeddings trained: each
    # device's float32 logits are 4 x 256 tokens of its share of the
    # vocabulary (128 MiB on one device, 16 MiB over a model axis of 8).
    config = dict(tiny_presets.GEMMA_MQA, vocabulary_size=32768, num_layers=1)
    preset = {"class_name": "GemmaBackbone", "config": config}
    plan = keras_hub_autodist.plan(preset, mesh)
    rows = 4 // mesh["batch"]
    logits = rows * 256 * 32768 // mesh.get("model", 1) * 4

    def compiled_temporaries():
        compiled = keras_hub_autodist.compiled_memory(plan, 4, 256, preset=preset)
        # No device gathers the vocabulary's logits (or any large part).
        gathered = [c.bytes for c in compiled.collectives if c.kind == "all-gather"]
        assert sum(gathered) < logits / 8
        return compiled.temp_bytes

    chunked_bytes = compiled_temporaries()
    monkeypatch.setattr(chunked_steps, "why_whole_logits", lambda *_: "compared")
    with pytest.warns(WholeLogitsWarning, match="compared"):
        whole_bytes = compiled_temporaries()  # Keras' own step
    assert whole_bytes > 2 * logits
    assert chunked_bytes <= 0.5 * logits
