"""The `keras-hub-autodist demo` main job: plan, LoRA fine-tune, generate.

With no preset it builds an embedded tiny Gemma (8 query heads, one key/value
head, like gemma_2b) with a real SentencePiece tokenizer trained
deterministically on the sentences below, saves it as a preset, and loads it
back with `device_mesh=`.
"""

from __future__ import annotations

import io
import os
import tempfile

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

TINY_GEMMA = dict(
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=16,
)


def sentencepiece_proto(sentences=SENTENCES, vocab_size: int = 64) -> bytes:
    """Train a small SentencePiece model with Gemma's special tokens.

    Training is deterministic for the same sentences and settings.

    Args:
        sentences: the training text.
        vocab_size: the wished vocabulary size (smaller if the text is short).

    Example:
    >>> proto = sentencepiece_proto()
    >>> len(proto) > 0
    True
    """
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(sentences) * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="word",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        pad_piece="<pad>",
        unk_piece="<unk>",
        bos_piece="<bos>",
        eos_piece="<eos>",
        user_defined_symbols=["<s>", "</s>", "<start_of_turn>", "<end_of_turn>"],
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return model.getvalue()


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
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=16
    )
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), **TINY_GEMMA
    )
    keras_hub.models.GemmaCausalLM(backbone, preprocessor).save_to_preset(path)
    return path


def llama3_vocabulary() -> tuple[dict, list]:
    """A byte-level BPE vocabulary and merges for lowercase text, for Llama 3.

    Example:
    >>> vocabulary, merges = llama3_vocabulary()
    >>> "<|begin_of_text|>" in vocabulary and "Ġ t" in merges
    True
    """
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merged = ["Ġt", "Ġa", "th", "Ġth", "in", "er"]
    tokens = letters + ["Ġ" + c for c in letters] + ["Ġ"] + merged
    special = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    merges = ["Ġ t", "Ġ a", "t h", "Ġt h", "i n", "e r"]
    return {t: i for i, t in enumerate(tokens + special)}, merges


def build_tiny_llama3_preset(path: str, *, seed: int = 0) -> str:
    """Save a tiny Llama 3 CausalLM (GQA 8/2, untied) as a preset in `path`.

    Args:
        path: a folder to create.
        seed: the seed of the random weights.

    Example:
    ```python
    build_tiny_llama3_preset("/tmp/tiny_llama3")
    ```
    """
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    vocabulary, merges = llama3_vocabulary()
    tokenizer = keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        tokenizer, sequence_length=16
    )
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )
    keras_hub.models.Llama3CausalLM(backbone, preprocessor).save_to_preset(path)
    return path


def has_accelerator() -> bool:
    """Whether a GPU or TPU is visible, checked without starting JAX."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    devices = os.listdir("/dev") if os.path.isdir("/dev") else []
    return any(d.startswith(("nvidia", "accel", "vfio")) for d in devices)


def use_virtual_cpu_devices(count: int = 8) -> None:
    """Give JAX `count` virtual CPU devices; call before JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={count}".strip()
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_demo(
    preset: str | None = None,
    mesh=None,
    strategy: str = "auto",
    steps: int = 3,
    prompt: str = "the quick brown",
) -> dict:
    """Plan, LoRA fine-tune and generate on a mesh; print as it goes.

    Args:
        preset: a preset path or handle; `None` builds the embedded tiny Gemma.
        mesh: a mapping such as `{"batch": 2, "model": 4}`; `None` uses that
            mapping for the embedded preset and `"auto"` otherwise.
        strategy: `"auto"`, `"tp"` or `"fsdp"`.
        steps: epochs of LoRA fine-tuning over the demo sentences.
        prompt: the text to complete.

    Returns:
        A dict with the `plan`, the training `losses` and the `completion`.

    Example:
    ```python
    run_demo()  # the embedded tiny Gemma on 8 (virtual) devices
    ```
    """
    import keras
    import keras_hub

    import keras_hub_autodist

    with tempfile.TemporaryDirectory() as scratch:
        if preset is None:
            print("Building the embedded tiny Gemma preset (1 key/value head)...")
            preset = build_tiny_gemma_preset(os.path.join(scratch, "tiny_gemma"))
            mesh = mesh or {"batch": 2, "model": 4}
        mesh = mesh or "auto"
        print(f"Devices: {keras.distribution.list_devices()}")
        lm = keras_hub.models.CausalLM.from_preset(
            preset, device_mesh=mesh, strategy=strategy
        )
        distribution, plan = keras_hub_autodist.distribution_of(lm)
        print()
        print(plan)
        print()
        lm.backbone.enable_lora(4)
        lm.compile(
            optimizer=keras.optimizers.Adam(5e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            sampler="greedy",
        )
        batch = plan.mesh_axes.size(plan.batch_axis) * 2
        print(f"LoRA fine-tuning, rank 4, batches of {batch}:")
        history = lm.fit(SENTENCES, batch_size=batch, epochs=steps, verbose=1)
        completion = lm.generate(prompt, max_length=12)
        print(f"\nCompletion of {prompt!r}: {completion!r}")
        assert keras.distribution.distribution() is None
    return {"plan": plan, "losses": history.history["loss"], "completion": completion}
