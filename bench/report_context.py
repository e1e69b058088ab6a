"""The report's sections on the sequence: sequence parallelism,
rematerialization, the context axis and long sequences."""

from __future__ import annotations

from bench.report_units import mib as _mib


def seqpar_section(row: dict) -> list[str]:
    """Temporary bytes of the train step with and without sequence parallelism."""
    verdict = "met" if row["met"] else "**not met**"
    ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
    estimate_ratio = f"{row['estimate_with'] / row['estimate_without']:.2f}"
    return [
        "### Sequence parallelism",
        "",
        f"Compiled SGD train step of {row['model']} on {row['mesh']}, batch "
        f"{row['batch']} x {row['sequence_length']} tokens, strategy `tp`; per-device",
        "temporary bytes from XLA's `memory_analysis()`.",
        "",
        "| | without | with `sequence_parallel=True` | ratio |",
        "|---|---|---|---|",
        f"| XLA temp MiB | {_mib(row['temp_without'])} | {_mib(row['temp_with'])} | {ratio} |",
        f"| planner's activation estimate MiB | {_mib(row['estimate_without'])} | "
        f"{_mib(row['estimate_with'])} | {estimate_ratio} |",
        "",
        f"Target: temporaries with sequence parallelism <= 0.3 x without: {verdict}"
        f" ({ratio}). Sequence parallelism shards the residual stream only; the",
        "attention scores (`b·H·s²`, already split by heads) and the logits (split by",
        "vocabulary) are the bulk of a long sequence's activations when attention",
        "materializes its scores, as XLA does here. The planner's own estimate puts",
        f"the best this can reach at {estimate_ratio}x, so 0.3x needs the scores",
        "sharded too (context parallelism, or a fused attention kernel that never",
        "stores them), which this option does not do.",
        "",
    ]


def remat_section(row: dict) -> list[str]:
    """The compiled peak of one step with and without `remat="full"`."""
    from bench import remat

    verdict = "met" if row["met"] else "**not met**"
    without, full = row["without"], row["full"]
    return [
        "### Rematerialization",
        "",
        f"Compiled SGD train step of {row['model']} on {row['mesh']}, batch "
        f"{row['batch']} x {row['sequence_length']} tokens, per device, from XLA's",
        f"`memory_analysis()` on {row['platform']} through "
        "`keras_hub_autodist.compiled_memory`,",
        "next to the closed-form estimate for that platform.",
        "",
        '| | without | `remat="full"` | ratio |',
        "|---|---|---|---|",
        f"| compiled peak MiB | {_mib(without['peak'])} | {_mib(full['peak'])} | "
        f"{row['ratio']:.2f} |",
        f"| temporaries MiB | {_mib(without['temp'])} | {_mib(full['temp'])} | "
        f"{full['temp'] / without['temp']:.2f} |",
        f"| estimate MiB | {_mib(without['estimate'])} | {_mib(full['estimate'])} | "
        f"{full['estimate'] / without['estimate']:.2f} |",
        "",
        f'Target: the peak with `"full"` <= {remat.TARGET} x without: {verdict} '
        f"({row['ratio']:.2f}).",
        "",
    ]


def context_section(result: dict, out_dir=None) -> list[str]:
    """Compiled memory against sequence length per context size, collective
    bytes against the hand-written reference, and the step-time ratio."""
    from bench import context

    sequences = sorted({r["sequence_length"] for r in result["grid"]})
    contexts = sorted({r["context"] for r in result["grid"]})
    peak = {(r["context"], r["sequence_length"]): r for r in result["grid"]}
    lines = [
        "### Context parallelism",
        "",
        f"Compiled SGD training step of {result['model']}, batch 1, on "
        '`{"batch": 1, "context": c}` (c devices), per device, from XLA',
        "`memory_analysis()` through `keras_hub_autodist.compiled_memory`:"
        " peak MiB (temporaries MiB).",
        "",
        "| tokens | " + " | ".join(f"context={c}" for c in contexts) + " |",
        "|---" * (len(contexts) + 1) + "|",
    ]
    for s in sequences:
        cells = [
            f"{_mib(peak[(c, s)]['peak'])} ({_mib(peak[(c, s)]['temp'])})"
            for c in contexts
        ]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    verdict = "met" if result["met"] else "**not met**"
    lines += [
        "",
        f"Target: peak at 4096 tokens with context=8 <= {context.TARGET} x one "
        f"device: {verdict} ({result['ratio_4096']:.2f}x).",
        "",
    ]
    if out_dir is not None:
        name = context.plot(result, out_dir)
        lines += [f"![context memory](img/{name})", ""]
    ours, reference = result["collectives"], result["reference"]

    def gathered(found):
        return found["all-gather"]["bytes"] + found["reduce-scatter"]["bytes"]

    steps = result["step_time"]
    medians = steps["median_s"]
    lines += [
        f"Collectives of the same step at {context.COLLECTIVE_SEQUENCE} tokens "
        "with context=8, against a hand-written `shard_map` attention that "
        "all-gathers the keys and values over the context axis (forward and "
        "backward, times the layers):",
        "",
        "| | all-gather + reduce-scatter MiB | all-reduce MiB |",
        "|---|---|---|",
        f"| autodist context=8 | {_mib(gathered(ours))} | "
        f"{_mib(ours['all-reduce']['bytes'])} |",
        f"| hand-written all-gather K/V | {_mib(gathered(reference))} | "
        f"{_mib(reference['all-reduce']['bytes'])} |",
        "",
        "The all-reduces are the gradients of the weights, which `tp` "
        "replicates over the context axis as data parallelism does over the "
        "batch axis (`fsdp` shards them over it instead); the reference "
        "computes attention alone and has none.",
        "",
        f"Step time at {steps['sequence_length']} tokens on the 8 CPU devices, "
        f"median of alternating steps: context=8 {medians['context=8']:.2f} s, "
        f"model=8 (tp) {medians['model=8 (tp)']:.2f} s: "
        f"{steps['ratio']:.2f}x.",
        "",
    ]
    if "long" in result:
        lines += long_context_lines(result["long"])
    return lines


def long_context_lines(long: dict) -> list[str]:
    """The long-context curve: compiled peak per device on `context=8` for
    each `context_parallel_strategy`, with its growth per doubling."""
    from bench import context

    sequences = long["sequences"]
    lines = [
        "Long sequences: the same step on "
        f'`{{"batch": 1, "context": {long["context"]}}}`, peak MiB per device '
        "(growth per doubling of the tokens), for each "
        "`context_parallel_strategy`, of "
        f"{long['models'][0]} and of llama_wide_kv (Llama 3, 8 key/value "
        "heads of 128, 2 layers, hidden 1024, vocabulary 8192, whose gathered "
        "keys and values reach 512 MiB per layer at 64k tokens):",
        "",
        "| model, strategy | " + " | ".join(str(s) for s in sequences) + " |",
        "|---" * (len(sequences) + 1) + "|",
    ]
    for strategy, curve in long["curves"].items():
        cells = [_mib(curve["peaks"][0])] + [
            f"{_mib(peak)} (x{growth:.2f})"
            for peak, growth in zip(curve["peaks"][1:], curve["growth"])
        ]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    verdict = "met" if long["met"] else "**not met**"
    lines += [
        "",
        f"Target: at most x{context.GROWTH_TARGET} per doubling (memory linear "
        f"in the sequence; a square is x4): {verdict} (worst "
        f"x{long['worst_growth']:.2f}).",
        "",
    ]
    return lines
