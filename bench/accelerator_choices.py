"""What `python -m bench --accelerator` measures on each kind of machine.

A run measures for one accelerator family, "gpu" or "tpu", named by its
target (`--target`, by default the machine's own: `target_of`; on a CPU the
v5e, the accelerator the project has at hand). The family chooses:

- the parts and their order (`PARTS`), and each part's share of the time
  (`BUDGET_S`): a TPU session runs one command of at most 10 minutes;
- the model loaded (`LOAD_MODEL`): a Gemma 7B shape fits an H200 but not a
  16 GiB v5e in bfloat16 with room, so a TPU loads the Gemma 2B shape;
- the attention cases (`attention_cases`): cuDNN's fused kernel on a GPU,
  Pallas' splash kernel on a TPU, each beside the context axis' per-device
  blockwise attention; never cuDNN on a TPU.
"""

from __future__ import annotations

# family -> the parts measured, in order: on a TPU the training steps come
# first, so that a run cut short by its time keeps them.
PARTS = {
    "gpu": ("load", "train", "long", "attention"),
    "tpu": ("train", "load", "attention"),
}
# `speed` (autodist against keras-hub in alternated processes), `chunks`
# (the loss whole and in chunks, in one process) and `search` (the layout
# search's choices beside keras-hub's best runnable batch) run when asked:
# on a TPU each takes a whole command.
ALL_PARTS = ("load", "train", "long", "attention", "speed", "chunks", "search")
# family -> part -> seconds it may start measurements in (a measurement
# started inside its part's time runs to its end, cut at the per-child
# limit). None: no limit. The TPU's add to 430 s of measurements, beside
# about a minute of making the first preset and starting the chip.
BUDGET_S = {
    "gpu": {
        "load": None,
        "train": None,
        "long": None,
        "attention": None,
        "speed": None,
        "chunks": None,
        "search": None,
    },
    "tpu": {
        "train": 300,
        "load": 90,
        "attention": 40,
        "long": 60,
        "speed": 450,
        "chunks": 450,
        "search": 450,
    },
}
# family -> seconds after which no measurement starts (None: no limit): a
# TPU command may run 10 minutes.
TOTAL_S = {"gpu": None, "tpu": 450}
# family -> the model whose loading is measured.
LOAD_MODEL = {"gpu": "gemma_7b", "tpu": "gemma_2b"}
# family -> sequences of one Gemma 2B LoRA sequence (`long`) where the
# family measures no training steps for that part
# (`accelerator_steps.LONG_STEPS`: a TPU trains Gemma 3 1B at 8k and 32k).
LONG_SEQUENCES = {"gpu": [32768], "tpu": [8192]}
LONG_SEQUENCES_TINY = [256]
# The attention head shapes: (query heads, key/value heads, head_dim). The
# splash kernel lays its head dimension in lanes of 128.
ATTENTION_HEADS = (8, 1, 256)
ATTENTION_HEADS_TINY = (4, 1, 128)


def family_of(target: str) -> str:
    """The accelerator family ("gpu" or "tpu") of a target name.

    Example:
    >>> family_of("v5e"), family_of("h200")
    ('tpu', 'gpu')
    """
    from keras_hub_autodist.fitting.compile_targets import target_spec

    return target_spec(target).platform


def target_of(platform: str, device_kind: str) -> str:
    """The target (a `compile_targets.TARGETS` name) of this machine's
    device; "v5e" on a CPU or a device no target names.

    Example:
    >>> target_of("tpu", "TPU v5 lite"), target_of("gpu", "NVIDIA H200")
    ('v5e', 'h200')
    """
    from keras_hub_autodist.fitting.compile_targets import TARGETS

    if platform == "cpu":
        return "v5e"
    kind = device_kind.lower()
    # The target whose words name the kind most fully ("TPU v5 lite" is a
    # v5e, though "TPU v5" is in it too).
    matches = [
        (sum(len(w) for w in spec.kind_words), name)
        for name, spec in TARGETS.items()
        if spec.platform == platform
        and all(word.lower() in kind for word in spec.kind_words)
    ]
    return max(matches)[1] if matches else "v5e"


def attention_cases(family: str, tiny: bool) -> list[tuple[str, int, int]]:
    """The attention part's cases for `family`: (variant, queries, keys).

    A whole sequence on one device with the family's fused kernel and with
    the per-device blockwise attention, then one device's share (an eighth)
    of a context axis of 8. Tiny shapes add XLA's own attention, which holds
    every score (too much at 32k tokens).

    Example:
    >>> [case[0] for case in attention_cases("tpu", tiny=False)]
    ['splash', 'blockwise', 'blockwise']
    """
    fused = {"gpu": "cudnn", "tpu": "splash"}[family]
    keys = 256 if tiny else 32768
    cases = [(fused, keys, keys), ("blockwise", keys, keys)]
    cases.append(("blockwise", keys // 8 if not tiny else 64, keys))
    if tiny:
        cases.insert(0, ("xla", keys, keys))
    # On a tiny run the fused kernels need their own hardware, but for
    # splash, which runs in Pallas' interpreter anywhere.
    if tiny and fused == "cudnn":
        cases = [c for c in cases if c[0] != "cudnn"]
    return cases


def parts_of(family: str, asked: str | None) -> tuple[str, ...]:
    """The parts to run: those `asked` (comma-separated), else the family's.

    Raises:
        SystemExit: for a part that does not exist.
    """
    if not asked:
        return PARTS[family]
    parts = tuple(asked.split(","))
    unknown = set(parts) - set(ALL_PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; known: {ALL_PARTS}")
    return parts
