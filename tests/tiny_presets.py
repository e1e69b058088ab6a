"""Tiny, real keras-hub presets written with `save_to_preset`, for tests.

Each builder writes a CausalLM preset (backbone, tokenizer, preprocessor) into
a folder. Shapes are small but keep the features that matter for layouts:
MQA/GQA, untied embeddings, vocabularies that don't divide by 8, soft caps.
"""

from __future__ import annotations

import json
import os

import keras
import keras_hub
import numpy as np

from keras_hub_autodist import demo

# The demo's first six sentences: the tokenizer the tests were written against.
SENTENCES = demo.SENTENCES[:6]


def sentencepiece_proto(vocab_size: int = 48) -> bytes:
    """A small SentencePiece model with Gemma/Llama special tokens."""
    return demo.sentencepiece_proto(SENTENCES, vocab_size)


llama3_vocabulary = demo.llama3_vocabulary


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


def _save(task, path):
    task.save_to_preset(path)
    return str(path)


def _restore_tie_word_embeddings(path, tied):
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


def gemma_preset(path, config=GEMMA_MQA, seed=0):
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=sentencepiece_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=8
    )
    config = {**config, "vocabulary_size": tokenizer.vocabulary_size()}
    backbone = keras_hub.models.GemmaBackbone(**config)
    return _save(keras_hub.models.GemmaCausalLM(backbone, preprocessor), path)


def gemma3_preset(path, config=GEMMA3_TEXT, seed=0):
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.Gemma3Tokenizer(
        proto=sentencepiece_proto(), has_vision_tokens=False
    )
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=8
    )
    config = {**config, "vocabulary_size": tokenizer.vocabulary_size()}
    backbone = keras_hub.models.Gemma3Backbone(**config)
    return _save(keras_hub.models.Gemma3CausalLM(preprocessor, backbone), path)


def llama3_preset(path, tie_word_embeddings=False, seed=0):
    keras.utils.set_random_seed(seed)
    vocabulary, merges = llama3_vocabulary()
    tokenizer = keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        tokenizer, sequence_length=8
    )
    config = {**LLAMA3, "vocabulary_size": tokenizer.vocabulary_size()}
    backbone = keras_hub.models.Llama3Backbone(
        **config, tie_word_embeddings=tie_word_embeddings
    )
    path = _save(keras_hub.models.Llama3CausalLM(backbone, preprocessor), path)
    _restore_tie_word_embeddings(path, tie_word_embeddings)
    return path


BUILDERS = {
    "gemma_mqa": gemma_preset,
    "gemma2_gqa": lambda path: gemma_preset(path, GEMMA2_GQA),
    "gemma3_text": gemma3_preset,
    "llama3_untied": llama3_preset,
    "llama3_tied": lambda path: llama3_preset(path, tie_word_embeddings=True),
}


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
