"""The accelerator bench's part `chunks`: every chunk rule timed in one
process, in turns, the rules put back after; a tiny run on this CPU."""

import keras
import keras_hub
import pytest

from bench import accelerator_choices as choices
from bench import accelerator_chunks
from bench import accelerator_render
from bench import accelerator_steps
from keras_hub_autodist.loss import chunked_steps
from keras_hub_autodist.loss import chunks


def test_the_rules_alternate_in_one_process_and_are_asked_for_by_name():
    assert "chunks" in choices.ALL_PARTS and "chunks" not in choices.PARTS["tpu"]
    order = accelerator_chunks.chunk_order(2)
    names = list(accelerator_chunks.CHUNK_VARIANTS)
    assert order == [(0, n) for n in names] + [(1, n) for n in names[::-1]]
    named = {s.name(b) for s in accelerator_steps.TPU_CHUNK_STEPS for b in s.batches}
    assert named == {"gemma_2b lora8 4x1024", "gemma_2b lora8 8x1024"}


@pytest.mark.parametrize(
    "variant, expected",
    [("whole logits", 1), ("chunks of 256 MiB", 32), ("chunks of 512 tokens", 16)],
)
def test_each_rule_cuts_gemma_2b_as_named_and_is_put_back(variant, expected):
    saved = {name: getattr(chunks, name) for name in dir(chunks) if name.isupper()}
    counting = chunked_steps.chunk_count
    counts = []
    with accelerator_chunks.chunk_rule(variant, counts):
        # Gemma 2B LoRA, 8 x 1024 tokens: 1 GiB of frozen head.
        assert chunked_steps.chunk_count(8, 1024, 256000, 1, 2**30, 0) == expected
    assert counts == [expected]
    assert chunked_steps.chunk_count is counting
    assert {name: getattr(chunks, name) for name in saved} == saved


def test_a_tiny_run_times_every_rule_with_the_same_first_loss(tmp_path, monkeypatch):
    import jax

    from bench import accelerator_training

    # The chip's one device, among this machine's eight.
    one = keras.distribution.DeviceMesh((1, 1), ("batch", "model"), jax.devices()[:1])
    monkeypatch.setattr(accelerator_training, "ONE_DEVICE", one)
    _, config = accelerator_steps.model_config("gemma_2b", tiny=True)
    keras.utils.set_random_seed(0)
    path = str(tmp_path / "tiny")
    keras_hub.models.GemmaBackbone(**config, dtype="bfloat16").save_to_preset(path)
    rows = []
    accelerator_chunks.child_chunks(path, 4, 2, 32, 2, 1, emit=rows.append)
    assert [(r["round"], r["variant"]) for r in rows] == accelerator_chunks.chunk_order(
        accelerator_chunks.CHUNK_ROUNDS
    )
    assert not [r for r in rows if "error" in r]
    by_variant = {r["variant"]: r for r in rows}
    # A small head is cut into 32 chunks under the rules; whole, not cut.
    assert by_variant["whole logits"]["chunks"] == 1
    assert by_variant["chunks of 512 tokens"]["chunks"] > 1
    # The same weights and batch: the first loss doesn't depend on the rule.
    first = [r["first_loss"] for r in rows]
    assert max(first) - min(first) < 1e-5 * abs(first[0])
    assert all(r["program_bytes"] > 0 and r["step_s"] > 0 for r in rows)

    named = [dict(r, step="tiny") for r in rows]
    table = accelerator_render._chunk_lines(dict(chunks=named))
    whole = [line for line in table if line.startswith("| tiny | whole logits | 1 |")]
    assert len(whole) == 1 and "| 1.000 |" in whole[0]
    assert len([line for line in table if line.startswith("| tiny |")]) == 3
