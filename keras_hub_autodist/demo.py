"""The `keras-hub-autodist demo` main job: plan, LoRA fine-tune, generate.

With no preset it builds an embedded tiny Gemma (8 query heads, one key/value
head, like gemma_2b) with a real SentencePiece tokenizer trained
deterministically on the sentences below, saves it as a preset, and loads it
back with `device_mesh=`. The LoRA fine-tune teaches the random model the
sentences: the loss before and after, and the greedy completion of
"the quick brown" before and after, show what it changed.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings
from collections.abc import Sequence

from keras_hub_autodist.devices import describe_devices
from keras_hub_autodist.tiny_tokenizers import llama3_vocabulary
from keras_hub_autodist.tiny_tokenizers import sentencepiece_proto
from keras_hub_autodist.words import counted

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "keras hub models run on many devices",
    "a mesh has a batch axis and a model axis",
    "gemma and llama are language models",
    "sharding splits weights over devices",
    "data parallel training splits the batch",
    "tensor parallel training splits the weights",
    "the planner reads the config before the model is built",
]

# The fine-tune: LoRA of rank 16 on the query and value kernels (a quarter of
# the tiny model's hidden size), Adam at 3e-2. The default 48 steps make
# the tiny Gemma complete PROMPT with TARGET (about 16 are enough).
LORA_RANK = 16
LEARNING_RATE = 3e-2
STEPS = 48
PROMPT = "the quick brown"
TARGET = SENTENCES[0]
MAX_LENGTH = 12

TINY_GEMMA = dict(
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=16,
)


def build_tiny_gemma_preset(path: str, *, seed: int = 0) -> str:
    """Save the embedded tiny Gemma CausalLM as a preset in `path`.

    Args:
        path: a folder to create.
        seed: the seed of the random weights.

    Example:
    ```python
    build_tiny_gemma_preset("/tmp/tiny_gemma")
    ```
    """
    import keras_hub

    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto(SENTENCES))
    return _save_tiny_causal_lm(path, seed, "Gemma", tokenizer, **TINY_GEMMA)


def build_tiny_llama3_preset(
    path: str, *, seed: int = 0, sentences: Sequence[str] = ()
) -> str:
    """Save a tiny Llama 3 CausalLM (GQA 8/2, untied) as a preset in `path`.

    Its tokenizer splits text into letters, and keeps the words of
    `sentences` whole (`SENTENCES` for a model that can learn them in a few
    dozen steps).

    Args:
        path: a folder to create.
        seed: the seed of the random weights.
        sentences: text whose words get tokens of their own.

    Example:
    ```python
    build_tiny_llama3_preset("/tmp/tiny_llama3")
    ```
    """
    import keras_hub

    vocabulary, merges = llama3_vocabulary(sentences)
    tokenizer = keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=merges)
    return _save_tiny_causal_lm(
        path,
        seed,
        "Llama3",
        tokenizer,
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )


def _save_tiny_causal_lm(path, seed, family, tokenizer, **backbone_config) -> str:
    """Save keras-hub's `{family}CausalLM` with random weights (`seed`) and a
    16-token preprocessor as a preset in `path`; the backbone's vocabulary
    is the tokenizer's."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    models = keras_hub.models
    preprocessor = getattr(models, f"{family}CausalLMPreprocessor")(
        tokenizer, sequence_length=16
    )
    backbone_config["vocabulary_size"] = tokenizer.vocabulary_size()
    backbone = getattr(models, f"{family}Backbone")(**backbone_config)
    getattr(models, f"{family}CausalLM")(backbone, preprocessor).save_to_preset(path)
    return path


def describe_plan(plan) -> str:
    """The plan's table and summary, as `keras-hub-autodist plan` prints them
    (fallbacks counted in the table's rows, with the weights they cover).

    Args:
        plan: a `keras_hub_autodist.LayoutPlan`.
    """
    return str(plan)


def _cycle(texts: list[str], count: int) -> list[str]:
    return [texts[i % len(texts)] for i in range(count)]


def _scores(lm, texts: list[str], batch: int) -> tuple[float, float | None]:
    scores = lm.evaluate(texts, batch_size=batch, verbose=0, return_dict=True)
    return scores["loss"], scores.get("sparse_categorical_accuracy")


def _complete(lm, prompt: str) -> str:
    # One prompt is padded to the devices of the batch axis: by design here
    # (the demo shows one completion), so the padding notice meant for a
    # user's own batches is not shown.
    from keras_hub_autodist.errors import PaddingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PaddingWarning)
        return lm.generate(prompt, max_length=MAX_LENGTH)


def _describe_scores(loss: float, accuracy: float | None) -> str:
    if accuracy is None:
        return f"loss {loss:.3f}"
    return f"loss {loss:.3f}, next-token accuracy {accuracy:.0%}"


def _check_steps(steps) -> None:
    from keras_hub_autodist.errors import DemoError
    from keras_hub_autodist.errors import option

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DemoError(
            "The demo fine-tunes for a positive number of steps; pass "
            f"{option('steps')} 1 or more ({STEPS} by default). Received: "
            f"steps={steps!r}"
        )


def run_demo(
    preset: str | None = None,
    mesh=None,
    strategy: str = "auto",
    steps: int = STEPS,
    prompt: str = PROMPT,
) -> dict:
    """Plan, LoRA fine-tune and generate on a mesh; print as it goes.

    The loss on the demo sentences and the greedy completion of `prompt` are
    shown before and after the fine-tune.

    Args:
        preset: a preset path or handle; `None` builds the embedded tiny Gemma.
        mesh: a mapping such as `{"batch": 2, "model": 4}`; `None` uses that
            mapping for the embedded preset and `"auto"` otherwise.
        strategy: `"auto"`, `"tp"` or `"fsdp"`.
        steps: optimizer steps of LoRA fine-tuning (batches) over the demo
            sentences, in one epoch.
        prompt: the text to complete.

    Returns:
        A dict with the `plan`, the training `losses` (of the epoch), the
        optimizer `steps` taken, the
        `loss_before` and `loss_after` on the demo sentences, and the
        `completion_before` and `completion` (after) of `prompt`.

    Example:
    ```python
    run_demo()  # the embedded tiny Gemma on 8 (virtual) devices
    ```
    """
    _check_steps(steps)
    import keras
    import keras_hub

    import keras_hub_autodist

    embedded = preset is None
    with tempfile.TemporaryDirectory() as scratch:
        if embedded:
            print("Building the embedded tiny Gemma preset (1 key/value head)...")
            preset = build_tiny_gemma_preset(os.path.join(scratch, "tiny_gemma"))
            mesh = mesh or {"batch": 2, "model": 4}
        mesh = mesh or "auto"
        print(f"Devices: {describe_devices()}")
        # Seeded before the preset's tokenizer exists: seeding afterwards
        # breaks a SentencePiece tokenizer's tf.data pipeline (tf.random
        # resets the eager context, which drops the tokenizer's resource).
        keras.utils.set_random_seed(0)
        lm = keras_hub.models.CausalLM.from_preset(
            preset, device_mesh=mesh, strategy=strategy
        )
        distribution, plan = keras_hub_autodist.distribution_of(lm)
        print()
        print(describe_plan(plan))
        print()
        lm.backbone.enable_lora(LORA_RANK)
        lm.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            sampler="greedy",
        )
        batch = plan.mesh_axes.size(plan.batch_axis) * 4
        sentences = _cycle(SENTENCES, batch * math.ceil(len(SENTENCES) / batch))
        loss_before, accuracy_before = _scores(lm, sentences, batch)
        before = _complete(lm, prompt)
        print(f"Before fine-tuning: {_describe_scores(loss_before, accuracy_before)}")
        print(f"  completion of {prompt!r}: {before!r}")
        print(
            f"\nLoRA fine-tuning (rank {LORA_RANK}, Adam {LEARNING_RATE:g}): "
            f"{counted(steps, 'step')}, batches of {batch}"
        )
        history = lm.fit(
            _cycle(SENTENCES, steps * batch),
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=2,
        )
        loss_after, accuracy_after = _scores(lm, sentences, batch)
        completion = _complete(lm, prompt)
        print(f"\nAfter fine-tuning: {_describe_scores(loss_after, accuracy_after)}")
        print(f"  completion of {prompt!r}: {completion!r}")
        taken = counted(steps, "step")
        if TARGET in completion:
            print(f"After {taken}, {prompt!r} completes to the demo sentence.")
        elif embedded and prompt == PROMPT:
            print(
                f"After {taken}, not yet the demo sentence {TARGET!r}: the "
                f"default of {STEPS} steps gets there."
            )
        assert keras.distribution.distribution() is None
    return {
        "plan": plan,
        "losses": history.history["loss"],
        "steps": int(lm.optimizer.iterations.numpy()),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "completion_before": before,
        "completion": completion,
    }
