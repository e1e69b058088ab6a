"""Tiny tokenizers trained in a second, for the demo's and the tests'
presets: a SentencePiece model with Gemma's special tokens, and a byte-level
BPE vocabulary for Llama 3."""

from __future__ import annotations

import io
from collections.abc import Sequence


def sentencepiece_proto(sentences, vocab_size: int = 64) -> bytes:
    """Train a small SentencePiece model with Gemma's special tokens.

    Training is deterministic for the same sentences and settings.

    Args:
        sentences: the training text.
        vocab_size: the wished vocabulary size (smaller if the text is short).

    Example:
    >>> proto = sentencepiece_proto(["a tiny text", "another tiny text"])
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


def llama3_vocabulary(sentences: Sequence[str] = ()) -> tuple[dict, list]:
    """A byte-level BPE vocabulary and merges for lowercase text, for Llama 3:
    letters, a few pairs, and the words of `sentences` whole (each built by
    merging its letters left to right, with and without a leading space).

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
    words = sorted({word for sentence in sentences for word in sentence.split()})
    for piece in [form for word in words for form in (word, "Ġ" + word)]:
        for end in range(2, len(piece) + 1):
            merge = f"{piece[: end - 1]} {piece[end - 1]}"
            if merge not in merges:
                merges.append(merge)
            if piece[:end] not in tokens:
                tokens.append(piece[:end])
    return {t: i for i, t in enumerate(tokens + special)}, merges
