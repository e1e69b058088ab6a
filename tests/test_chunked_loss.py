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
def small_chunks(monkeypatch):
    """Chunks of a few tokens, so that the tiny models take several (their
    trained heads would otherwise keep them whole: `chunk_count`)."""
    monkeypatch.setattr(chunk_rule, "CHUNK_LOGITS_BYTES", 2048)
    monkeypatch.setattr(chunk_rule, "WHOLE_LOGITS_BYTES", 0)
    count = chunked_steps.chunk_count
    monkeypatch.setattr(chunked_steps, "chunk_count", lambda *args: count(*args[:4]))


@pytest.fixture
def chunk_calls(monkeypatch):
    """The chunk counts every chunked loss was traced with."""
    calls = []
    original = chunked_steps.chunked_cross_entropy

    def counting(head, hidden, labels, chunks):
        calls.append(chunks)
        return original(head, hidden, labels, chunks)

    monkeypatch.setattr(chunked_steps, "chunked_cross_entropy", counting)
    return calls


def test_chunks_match_whole_logits_in_value_and_gradient():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 12, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 12)), jnp.int32)

    def whole(hidden, kernel):
        logits = jnp.tanh(hidden @ kernel / 5.0) * 5.0
        entropy = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, labels[..., None], -1
        ).squeeze(-1)
        return entropy, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)

    def in_chunks(hidden, kernel, chunks):
        head = lambda h: jnp.tanh(h @ kernel / 5.0) * 5.0  # noqa: E731
        return chunked.chunked_cross_entropy(head, hidden, labels, chunks)

    expected, expected_matches = whole(hidden, kernel)
    expected_grads = jax.grad(lambda h, k: whole(h, k)[0].sum(), (0, 1))(hidden, kernel)
    for chunks in (1, 3, 4, 12):
        entropy, matches = in_chunks(hidden, kernel, chunks)
        np.testing.assert_allclose(entropy, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(matches, expected_matches)
        grads = jax.grad(
            lambda h, k, chunks=chunks: in_chunks(h, k, chunks)[0].sum(), (0, 1)
        )(hidden, kernel)
        for got, want in zip(grads, expected_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="Received: chunks=5, sequence=12"):
        in_chunks(hidden, kernel, 5)


def test_chunk_counts_divide_each_part_of_a_split_sequence():
    assert chunk_rule.chunk_count(1, 32768, 262144) == 128
    # Over 4 context devices, each holds 8192 tokens: the count divides it.
    assert chunk_rule.chunk_count(1, 32768, 262144, splits=4) == 32
    # Whole logits of up to 4 GiB a device keep Keras' own step.
    assert chunk_rule.chunk_count(8, 64, 1000) == 1
    assert chunk_rule.chunk_count(1, 4096, 262144) == 1
    # A trained head of 1 GiB: chunks of up to 2 GiB of logits, since
    # cutting them costs one more gradient of the head.
    gib = 2**30
    assert chunk_rule.chunk_count(16, 1024, 128256, trained_head_bytes=gib) == 4
    # A prime length can only be cut token by token.
    assert chunk_rule.chunk_count(64, 4099, 262144) == 4099


def _batch(vocabulary, rows=8, padded_tail=4):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (rows, SEQUENCE)).astype("int32")
    padding = np.ones_like(ids)
    padding[:, SEQUENCE - padded_tail :] = 0
    x = {"token_ids": ids, "padding_mask": padding}
    return x, np.roll(ids, -1, axis=1), padding.astype("float32")


def _train(path, task_class, device_mesh=None, lora=False, rows=8, compile_args=()):
    kwargs = {} if device_mesh is None else {"device_mesh": device_mesh}
    lm = task_class.from_preset(path, preprocessor=None, **kwargs)
    if lora:
        keras.utils.set_random_seed(0)  # the same LoRA kernels in both runs
        lm.backbone.enable_lora(2)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), **dict(compile_args))
    x, y, weights = _batch(lm.backbone.vocabulary_size, rows)
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


CASES = {
    # Gemma 2: tied embeddings, soft-capped logits, vocabulary over model.
    "gemma2-batch2-model4": ("gemma2_gqa", {"batch": 2, "model": 4}, False, 8),
    "gemma2-lora-model8": ("gemma2_gqa", {"batch": 1, "model": 8}, True, 8),
    # Llama with its own output embedding; 6 rows padded to the batch axis.
    "llama-untied-batch4-model2-padded": (
        "llama3_untied",
        {"batch": 4, "model": 2},
        False,
        6,
    ),
    # Each sequence split over a context axis of 2.
    "gemma3-context2": (
        "gemma3_text",
        {"batch": 2, "context": 2, "model": 2},
        False,
        8,
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_bound_causal_lm_takes_its_loss_in_chunks_as_one_device_does(
    case, tiny_presets_dir, small_chunks, chunk_calls
):
    name, mesh, lora, rows = CASES[case]
    path = tiny_presets_dir[name]
    task_class = keras_hub.models.CausalLM
    reference = _train(path, task_class, lora=lora, rows=rows)
    assert chunk_calls == []  # an unbound model keeps Keras' own step
    ours = _train(path, task_class, mesh, lora=lora, rows=rows)
    # The training step and the evaluation step, each in several chunks.
    assert len(chunk_calls) == 2 and min(chunk_calls) > 1
    _assert_same(ours, reference)


def test_a_loss_or_metric_that_needs_whole_logits_keeps_them_and_says_why(
    tiny_presets_dir, small_chunks, chunk_calls
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


def test_the_compiled_step_holds_one_chunk_of_logits_not_the_vocabulary(
    monkeypatch,
):
    # A 32k vocabulary over a short model: the float32 logits of 4 x 256
    # tokens are 128 MiB, their gradient as much again.
    config = dict(tiny_presets.GEMMA_MQA, vocabulary_size=32768, num_layers=1)
    preset = {"class_name": "GemmaBackbone", "config": config}
    plan = keras_hub_autodist.plan(preset, {"batch": 1, "model": 1})
    logits = 4 * 256 * 32768 * 4
    monkeypatch.setattr(chunk_rule, "CHUNK_LOGITS_BYTES", logits // 16)
    monkeypatch.setattr(chunk_rule, "WHOLE_LOGITS_BYTES", logits // 2)

    def compiled_temporaries():
        compiled = keras_hub_autodist.compiled_memory(plan, 4, 256, preset=preset)
        return compiled.peak_bytes - compiled.argument_bytes

    chunked_bytes = compiled_temporaries()
    monkeypatch.setattr(chunk_rule, "WHOLE_LOGITS_BYTES", logits)
    whole_bytes = compiled_temporaries()  # Keras' own step
    assert whole_bytes > 2 * logits
    assert chunked_bytes < whole_bytes - 1.5 * logits
