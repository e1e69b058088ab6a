"""Tiny, real keras-hub presets for tests: one factory and what it saves.

`save_preset` writes a backbone, or a task around it, with keras-hub's own
`save_to_preset`. `BUILDERS` names every preset the tests share, and
`PresetFolder` (the `tiny_presets_dir` fixture of conftest.py) saves each on
first use. Shapes are small but keep the features that matter for layouts:
MQA/GQA, untied embeddings, vocabularies that don't divide by 8, soft caps,
experts that don't divide a model axis.

Example:

```python
path = save_preset(tmp_path / "gemma", keras_hub.models.GemmaBackbone, GEMMA_MQA)
lm = keras_hub.models.Backbone.from_preset(path, device_mesh={"batch": 8})
```
"""

from __future__ import annotations

import collections.abc
import functools
import json
import os
import pathlib

import keras
import keras_hub
import numpy as np

from keras_hub_autodist import tiny_tokenizers

# The text the tokenizers are trained on.
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "keras hub models run on many devices",
    "a mesh has a batch axis and a model axis",
    "gemma and llama are language models",
    "sharding splits weights over devices",
    "data parallel training splits the batch",
]


def sentencepiece_proto(vocab_size: int = 48) -> bytes:
    """A small SentencePiece model with Gemma's special tokens, trained
    deterministically on `SENTENCES`."""
    return tiny_tokenizers.sentencepiece_proto(SENTENCES, vocab_size)


# --- Configs: Gemma and Llama CausalLMs with tokenizers. ---------------------

GEMMA_MQA = dict(
    vocabulary_size=100,
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=1,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
)
GEMMA2_GQA = dict(
    vocabulary_size=96,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    query_head_dim_normalize=False,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    final_logit_soft_cap=30.0,
    attention_logit_soft_cap=50.0,
    use_sliding_window_attention=True,
    sliding_window_size=4,
)
# A Gemma of small width but long-context proportions (4 query heads, one
# key/value head of 64, a 32k vocabulary): the context-parallel memory curves.
GEMMA_SHAPED = dict(
    vocabulary_size=32768,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=256,
    intermediate_dim=1024,
    head_dim=64,
)
GEMMA3_TEXT = dict(
    vocabulary_size=100,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    image_size=16,
    vision_encoder=None,
    sliding_window_size=4,
    use_sliding_window_attention=True,
)
LLAMA3 = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
)

# --- Configs: Gemma 3 with its vision tower. ---------------------------------

GEMMA3_VISION_ENCODER = dict(
    image_size=16,
    patch_size=4,
    num_heads=2,
    hidden_dim=16,
    num_layers=2,
    intermediate_dim=32,
    output_dim=32,
    pool_size=2,
)
GEMMA3_VISION_TEXT = dict(
    vocabulary_size=100,
    image_size=16,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
)


def gemma3_vision_backbone(**config) -> keras_hub.models.Backbone:
    """A Gemma3Backbone of `config` with the tiny vision tower."""
    encoder = keras_hub.models.Gemma3VisionEncoder(**GEMMA3_VISION_ENCODER)
    return keras_hub.models.Gemma3Backbone(**config, vision_encoder=encoder)


# --- Configs: the dense families of the rule tables. --------------------------

# Shapes that make the layouts interesting: key/value heads that don't divide
# a model axis of 4 or 8, a vocabulary that doesn't divide 8.
QWEN2 = dict(
    vocabulary_size=60,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    tie_word_embeddings=False,
)
QWEN3 = dict(
    vocabulary_size=60,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_dim=32,
    intermediate_dim=64,
    tie_word_embeddings=True,
)
PHI3 = dict(
    vocabulary_size=60,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=32,
    intermediate_dim=64,
)
SMOLLM3 = dict(
    vocabulary_size=60,
    hidden_dim=32,
    intermediate_dim=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    attention_bias=False,
    attention_dropout=0.0,
    rope_layer_enabled_list=[True, False],
    layer_types=["full_attention", "full_attention"],
    mlp_bias=False,
    layer_norm_epsilon=1e-6,
    max_position_embeddings=64,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
)
# Gemma 4 dense: global layers with their own head size and a single
# key/value head shared by key and value, a key/value-sharing last layer.
GEMMA4 = dict(
    vocabulary_size=60,
    image_size=16,
    num_layers=3,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    head_dim=8,
    sliding_window_pattern=2,
    sliding_window_size=4,
    global_head_dim=16,
    num_global_key_value_heads=1,
    num_kv_shared_layers=1,
    vision_encoder=None,
    audio_encoder=None,
)

# name -> (backbone class, CausalLM class, config). The CausalLM class is
# named explicitly: keras-hub 0.32's `CausalLM.from_preset` picks between
# `Gemma4CausalLM` and `Gemma4AssistantCausalLM` (both on Gemma4Backbone) in
# set order, so by chance, and the assistant can't be built from these.
DENSE_FAMILIES = {
    "qwen2": (keras_hub.models.QwenBackbone, keras_hub.models.QwenCausalLM, QWEN2),
    "qwen3": (keras_hub.models.Qwen3Backbone, keras_hub.models.Qwen3CausalLM, QWEN3),
    "phi3": (keras_hub.models.Phi3Backbone, keras_hub.models.Phi3CausalLM, PHI3),
    "smollm3": (
        keras_hub.models.SmolLM3Backbone,
        keras_hub.models.SmolLM3CausalLM,
        SMOLLM3,
    ),
    "gemma4": (
        keras_hub.models.Gemma4Backbone,
        keras_hub.models.Gemma4CausalLM,
        GEMMA4,
    ),
    # Gemma 4 with its mixture of experts beside the dense MLP: 6 experts,
    # which a model axis of 4 does not divide (tensor parallel experts).
    "gemma4_moe": (
        keras_hub.models.Gemma4Backbone,
        keras_hub.models.Gemma4CausalLM,
        dict(
            GEMMA4,
            enable_moe_block=True,
            num_experts=6,
            expert_intermediate_dim=8,
            num_experts_per_token=2,
        ),
    ),
}
# Variants of the same families: tied/untied embeddings, biases.
DENSE_VARIANTS = {
    **DENSE_FAMILIES,
    "qwen2_tied": (
        *DENSE_FAMILIES["qwen2"][:2],
        dict(QWEN2, tie_word_embeddings=True),
    ),
    "qwen3_untied": (
        *DENSE_FAMILIES["qwen3"][:2],
        dict(QWEN3, tie_word_embeddings=False),
    ),
    "smollm3_biases": (
        *DENSE_FAMILIES["smollm3"][:2],
        dict(SMOLLM3, attention_bias=True, mlp_bias=True),
    ),
    # The small models' per-layer inputs.
    "gemma4_per_layer_inputs": (
        *DENSE_FAMILIES["gemma4"][:2],
        dict(GEMMA4, hidden_size_per_layer_input=4, use_double_wide_mlp=True),
    ),
    "gemma4_no_global_heads": (
        *DENSE_FAMILIES["gemma4"][:2],
        dict(
            GEMMA4,
            global_head_dim=None,
            num_global_key_value_heads=None,
            num_kv_shared_layers=0,
            attention_logit_soft_cap=50.0,
            final_logit_soft_cap=30.0,
        ),
    ),
}

# --- Configs: mixtures of experts. --------------------------------------------

MIXTRAL = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    num_experts=6,
    top_k=2,
)
QWEN_MOE = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    moe_intermediate_dim=16,
    shared_expert_intermediate_dim=24,
    num_experts=6,
    top_k=2,
)
QWEN3_MOE = dict(
    vocabulary_size=64,
    num_layers=3,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    moe_intermediate_dim=16,
    head_dim=8,
    num_experts=6,
    top_k=2,
    mlp_only_layers=[1],
)
# family -> (backbone class, CausalLM class, config).
MOE_FAMILIES = {
    "mixtral": (
        keras_hub.models.MixtralBackbone,
        keras_hub.models.MixtralCausalLM,
        MIXTRAL,
    ),
    "qwen_moe": (
        keras_hub.models.QwenMoeBackbone,
        keras_hub.models.QwenMoeCausalLM,
        QWEN_MOE,
    ),
    "qwen3_moe": (
        keras_hub.models.Qwen3MoeBackbone,
        keras_hub.models.Qwen3MoeCausalLM,
        QWEN3_MOE,
    ),
}


def moe_preset_name(family: str, num_experts: int) -> str:
    """The `BUILDERS` name of `family` with `num_experts` experts."""
    return f"{family}_{num_experts}_experts"


# --- The factory. --------------------------------------------------------------


def save_preset(
    path,
    backbone_class,
    config: dict,
    *,
    task_class=None,
    preprocessor=None,
    seed: int = 0,
    **save_kwargs,
) -> str:
    """Save `backbone_class(**config)`, or `task_class` around it, as a preset.

    Args:
        path: the folder to write.
        backbone_class: a backbone class, or a function that builds one from
            the config's keyword arguments.
        config: the backbone's keyword arguments.
        task_class: a task class (e.g. `keras_hub.models.GemmaCausalLM`) to
            save around the backbone, or `None` for the backbone alone.
        preprocessor: the task's preprocessor; `None` saves none.
        seed: the seed of the random weights.
        **save_kwargs: passed to `save_to_preset` (e.g. `max_shard_size`).

    Returns:
        The folder, as a string.
    """
    keras.utils.set_random_seed(seed)
    model = backbone_class(**config)
    if task_class is not None:
        model = task_class(backbone=model, preprocessor=preprocessor)
    model.save_to_preset(str(path), **save_kwargs)
    return str(path)


def gemma_preset(path, config=GEMMA_MQA, seed=0) -> str:
    """A GemmaCausalLM with a SentencePiece tokenizer and preprocessor."""
    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=8
    )
    return save_preset(
        path,
        keras_hub.models.GemmaBackbone,
        {**config, "vocabulary_size": tokenizer.vocabulary_size()},
        task_class=keras_hub.models.GemmaCausalLM,
        preprocessor=preprocessor,
        seed=seed,
    )


def gemma3_preset(path, config=GEMMA3_TEXT, seed=0) -> str:
    """A text-only Gemma3CausalLM with its tokenizer and preprocessor."""
    tokenizer = keras_hub.models.Gemma3Tokenizer(
        proto=sentencepiece_proto(), has_vision_tokens=False
    )
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=8
    )
    return save_preset(
        path,
        keras_hub.models.Gemma3Backbone,
        {**config, "vocabulary_size": tokenizer.vocabulary_size()},
        task_class=keras_hub.models.Gemma3CausalLM,
        preprocessor=preprocessor,
        seed=seed,
    )


def llama3_preset(path, tie_word_embeddings=False, seed=0) -> str:
    """A Llama3CausalLM with a BPE tokenizer and preprocessor."""
    vocabulary, merges = tiny_tokenizers.llama3_vocabulary()
    tokenizer = keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        tokenizer, sequence_length=8
    )
    path = save_preset(
        path,
        keras_hub.models.Llama3Backbone,
        {
            **LLAMA3,
            "vocabulary_size": tokenizer.vocabulary_size(),
            "tie_word_embeddings": tie_word_embeddings,
        },
        task_class=keras_hub.models.Llama3CausalLM,
        preprocessor=preprocessor,
        seed=seed,
    )
    _write_tie_word_embeddings(path, tie_word_embeddings)
    return path


def _write_tie_word_embeddings(path, tied):
    # keras-hub 0.32's LlamaBackbone.get_config() drops `tie_word_embeddings`,
    # so a tied Llama saved with save_to_preset reloads untied and fails to
    # load its weights. Write the field back (config.json and the backbone
    # inside task.json), as a fixed keras-hub would.
    def patch(node):
        if isinstance(node, dict):
            if (
                str(node.get("class_name", "")).endswith("LlamaBackbone")
                or node.get("class_name") == "Llama3Backbone"
            ):
                node["config"].setdefault("tie_word_embeddings", tied)
            for value in node.values():
                patch(value)
        elif isinstance(node, list):
            for value in node:
                patch(value)

    for name in ("config.json", "task.json"):
        file = os.path.join(path, name)
        with open(file) as f:
            config = json.load(f)
        patch(config)
        with open(file, "w") as f:
            json.dump(config, f, indent=4)


def _without_preprocessor(backbone_class, task_class, config):
    return functools.partial(
        save_preset, backbone_class=backbone_class, config=config, task_class=task_class
    )


# CausalLMs with a tokenizer and preprocessor.
CAUSAL_LMS = {
    "gemma_mqa": gemma_preset,
    "gemma2_gqa": functools.partial(gemma_preset, config=GEMMA2_GQA),
    "gemma3_text": gemma3_preset,
    "llama3_untied": llama3_preset,
    "llama3_tied": functools.partial(llama3_preset, tie_word_embeddings=True),
}
# Every shared preset: name -> a function that saves it into a folder.
BUILDERS = {
    **CAUSAL_LMS,
    # Bare backbones.
    "gemma_backbone": functools.partial(
        save_preset, backbone_class=keras_hub.models.GemmaBackbone, config=GEMMA_MQA
    ),
    "gemma3_vision_backbone": functools.partial(
        save_preset, backbone_class=gemma3_vision_backbone, config=GEMMA3_VISION_TEXT
    ),
    # CausalLMs without a preprocessor (`from_preset(..., preprocessor=None)`).
    **{name: _without_preprocessor(*spec) for name, spec in DENSE_VARIANTS.items()},
    **{
        moe_preset_name(family, experts): _without_preprocessor(
            backbone_class, task_class, {**config, "num_experts": experts}
        )
        for family, (backbone_class, task_class, config) in MOE_FAMILIES.items()
        for experts in (6, 8)
    },
}


class PresetFolder(collections.abc.Mapping):
    """Name -> folder of each preset of `BUILDERS`, saved on first use.

    Example:

    ```python
    presets = PresetFolder(tmp_path)
    lm = keras_hub.models.CausalLM.from_preset(presets["gemma_mqa"])
    ```
    """

    def __init__(self, root):
        self.root = pathlib.Path(root)
        self._saved = {}

    def __getitem__(self, name: str) -> str:
        if name not in self._saved:
            if name not in BUILDERS:
                raise KeyError(f"No tiny preset is named {name!r}: see BUILDERS.")
            self._saved[name] = BUILDERS[name](self.root / name)
        return self._saved[name]

    def __iter__(self):
        return iter(BUILDERS)

    def __len__(self) -> int:
        return len(BUILDERS)


def token_batch(batch_size, vocabulary_size, sequence_length=8, seed=0):
    """A deterministic batch of token ids for backbone-level training."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocabulary_size, size=(batch_size, sequence_length))
    return {
        "token_ids": ids.astype("int32"),
        "padding_mask": np.ones_like(ids, dtype="int32"),
    }


def folder_files(path):
    """(relative path, size, mtime) of every file below `path`."""
    found = []
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            stat = os.stat(full)
            found.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    return sorted(found)
