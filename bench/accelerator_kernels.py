"""`python -m bench.accelerator_kernels`: the per-device attention kernel
against XLA's attention, forward and backward, at each sequence length, on
one accelerator chip: the measurement the kernel rule is data of
(`keras_hub_autodist.attention.attention_blocks`).

Each case is one attention layer's shape of a family people fine-tune
(`SHAPES`: heads, key/value heads, head dimension, soft cap) at one length,
with `TOKENS` tokens a step (the batch is `TOKENS // length`), in bfloat16:

- `xla`: what keras-hub's layer computes on a TPU inside a training step,
  its keys and values repeated to the query heads: Keras'
  `dot_product_attention` with a traced mask falls back to
  `jax.nn.dot_product_attention` (XLA's), and a soft-capped layer takes
  keras-hub's own einsum, cap and softmax (the plugin's XLA path for it);
- `splash`: the plugin's call of Pallas' splash kernel
  (`attention.splash_attention.attend`), a head dimension of part lanes
  zero-padded to whole ones;
- `splash_native`: the same without the padding, where the head dimension
  is not whole lanes (does the kernel take it as it is, and how fast?).

Every case reports its median seconds over `REPEATS` calls after two
warm-ups, or the compiler's refusal; one length per shape is also checked
against a float32 reference. Results go to `$OUT/kernels.jsonl` as they
come and a table to `$OUT/kernels.md`. `--tiny` runs small shapes on any
machine (splash in Pallas' interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

# name -> (query heads, key/value heads, head dimension, soft cap).
SHAPES = {
    "llama3.2_1b": (32, 8, 64, None),
    "qwen2.5_0.5b": (14, 2, 64, None),
    "phi3_mini": (32, 32, 96, None),
    "gemma2_2b": (8, 4, 256, 50.0),
    "gemma3_1b": (4, 1, 256, None),
}
TINY_SHAPES = {"tiny64": (4, 2, 64, None), "tiny_capped": (2, 1, 128, 50.0)}
LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192)
TINY_LENGTHS = (256,)
TOKENS = 8192
TINY_TOKENS = 512
REPEATS = 10
# The length each shape is checked against the float32 reference at.
CHECK_LENGTH = 1024
# No case starts after this many seconds (a TPU command runs 10 minutes).
BUDGET_S = 420


def _inputs(heads, kv_heads, head_dim, batch, length, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q = normal(batch, length, heads, head_dim)
    k = normal(batch, length, kv_heads, head_dim)
    v = normal(batch, length, kv_heads, head_dim)
    cotangent = normal(batch, length, heads, head_dim)
    return q, k, v, cotangent


def attention(variant, heads, kv_heads, head_dim, soft_cap, length, interpret):
    """`attend(q, k, v, valid)` of `variant` over `[batch, length, heads,
    head_dim]` queries and `[batch, length, kv_heads, head_dim]` keys and
    values; `valid` is `[batch, length]` bool (padding `False`)."""
    import jax
    import jax.numpy as jnp

    from keras_hub_autodist.attention import splash_attention
    from keras_hub_autodist.attention.blockwise_attention import AttentionRule

    scale = head_dim**-0.5
    groups = heads // kv_heads
    causal = jnp.tril(jnp.ones((length, length), bool))
    if variant in ("xla", "reference"):
        dtype = jnp.float32 if variant == "reference" else jnp.bfloat16

        def attend(q, k, v, valid):
            q, k, v = (a.astype(dtype) for a in (q, k, v))
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            mask = causal[None, None] & valid[:, None, None, :]
            if soft_cap is None:
                return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
            # keras-hub's own path for a capped layer: einsum, cap, softmax.
            logits = jnp.einsum("btnh,bsnh->bnts", q * scale, k)
            logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
            weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
            return jnp.einsum("bnts,bsnh->btnh", weights, v)

        return attend
    rule = AttentionRule(scale=scale, soft_cap=soft_cap)
    kernel = splash_attention.splash_kernel(rule, length, 1, False, groups, interpret)
    width = head_dim if variant == "splash_native" else None
    positions = jnp.arange(length, dtype=jnp.int32)

    def attend(q, k, v, valid):
        batch = q.shape[0]
        grouped = q.reshape(batch, length, kv_heads, groups, head_dim)
        out = splash_attention.attend(
            kernel, rule, grouped, k, v, positions, valid, head_dim=width
        )
        return out.reshape(batch, length, heads, head_dim)

    return attend


def _step(attend):
    """`jit` of the attention's output and its gradients."""
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, valid, cotangent):
        out = attend(q, k, v, valid)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def measure(name, variant, length, tokens, interpret) -> dict:
    """One case's median seconds a step, or the compiler's refusal."""
    import jax
    import jax.numpy as jnp

    heads, kv_heads, head_dim, soft_cap = (SHAPES | TINY_SHAPES)[name]
    batch = max(tokens // length, 1)
    q, k, v, cotangent = _inputs(heads, kv_heads, head_dim, batch, length)
    valid = jnp.ones((batch, length), bool)
    row = dict(shape=name, variant=variant, length=length, batch=batch)
    attend = attention(variant, heads, kv_heads, head_dim, soft_cap, length, interpret)
    step = _step(attend)
    start = time.perf_counter()
    try:
        compiled = step.lower(q, k, v, valid, cotangent).compile()
    except Exception as error:  # the compiler's refusal, kept as data
        return dict(row, refused=f"{type(error).__name__}: {str(error)[:300]}")
    row["compile_s"] = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    row["temp_bytes"] = getattr(analysis, "temp_size_in_bytes", 0)
    for _ in range(2):
        jax.block_until_ready(compiled(q, k, v, valid, cotangent))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, valid, cotangent))
        times.append(time.perf_counter() - start)
    row["step_s"] = statistics.median(times)
    return row


def check(name, variant, length, interpret) -> dict:
    """The largest error of `variant`'s output and gradients against the
    float32 reference, relative to the reference's largest value; half of
    the keys of the second row are padding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    heads, kv_heads, head_dim, soft_cap = (SHAPES | TINY_SHAPES)[name]
    q, k, v, cotangent = _inputs(heads, kv_heads, head_dim, 2, length, seed=1)
    valid = jnp.ones((2, length), bool).at[1, length // 2 :].set(False)
    results = {}
    for which in ("reference", variant):
        attend = attention(
            which, heads, kv_heads, head_dim, soft_cap, length, interpret
        )
        with jax.default_matmul_precision("highest"):
            results[which] = jax.device_get(_step(attend)(q, k, v, valid, cotangent))
    errors = []
    for ours, truth in zip(
        jax.tree.leaves(results[variant]), jax.tree.leaves(results["reference"])
    ):
        ours, truth = np.asarray(ours, np.float64), np.asarray(truth, np.float64)
        errors.append(float(np.abs(ours - truth).max() / np.abs(truth).max()))
    return dict(shape=name, variant=variant, length=length, check=max(errors))


def cases(tiny: bool, lengths=None):
    shapes = TINY_SHAPES if tiny else SHAPES
    for length in lengths or (TINY_LENGTHS if tiny else LENGTHS):
        for name, (_, _, head_dim, _) in shapes.items():
            yield name, "xla", length
            yield name, "splash", length
            if head_dim % 128:
                yield name, "splash_native", length


def table(rows: list[dict]) -> str:
    """Markdown: per shape and length, XLA's seconds and each kernel's
    speed against it (XLA's seconds over the kernel's)."""
    timed = {
        (r["shape"], r["length"], r["variant"]): r
        for r in rows
        if "step_s" in r or "refused" in r
    }
    lines = [
        "| shape | length x batch | XLA ms | splash vs XLA | splash unpadded vs XLA |",
        "|---|---|---|---|---|",
    ]
    seen = sorted({(shape, length) for shape, length, _ in timed})
    for shape, length in seen:
        xla = timed.get((shape, length, "xla"), {})
        cells = []
        for variant in ("splash", "splash_native"):
            row = timed.get((shape, length, variant), {})
            if "refused" in row:
                cells.append("refused")
            elif "step_s" in row and "step_s" in xla:
                cells.append(f"{xla['step_s'] / row['step_s']:.2f}x")
            elif "step_s" in row:
                cells.append(f"{row['step_s'] * 1e3:.2f} ms (XLA refused)")
            else:
                cells.append("")
        xla_ms = f"{xla['step_s'] * 1e3:.2f}" if "step_s" in xla else "refused"
        batch = xla.get("batch", "")
        lines.append(
            f"| {shape} | {length} x {batch} | {xla_ms} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/kernels-out"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shapes", help="comma-separated keys of SHAPES")
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help="no case starts after it"
    )
    parser.add_argument("--lengths", help="comma-separated lengths of LENGTHS")
    args = parser.parse_args(argv)
    import jax

    import keras_hub_autodist  # noqa: F401  (the package, as a user imports it)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    interpret = jax.devices()[0].platform != "tpu"
    tokens = TINY_TOKENS if args.tiny else TOKENS
    chosen = set(args.shapes.split(",")) if args.shapes else None
    rows = []
    start = time.perf_counter()
    with open(out / "kernels.jsonl", "a") as log:

        def keep(row):
            row["device"] = jax.devices()[0].device_kind
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(row, flush=True)

        shapes = TINY_SHAPES if args.tiny else SHAPES
        length = TINY_LENGTHS[0] if args.tiny else CHECK_LENGTH
        for name, (_, _, head_dim, _) in shapes.items():
            if chosen and name not in chosen:
                continue
            variants = ["splash"] + (["splash_native"] if head_dim % 128 else [])
            for variant in variants:
                try:
                    keep(check(name, variant, length, interpret))
                except Exception as error:
                    keep(
                        dict(shape=name, variant=variant, check_failed=str(error)[:300])
                    )
        lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else None
        for name, variant, length in cases(args.tiny, lengths):
            if chosen and name not in chosen:
                continue
            if time.perf_counter() - start > args.budget:
                print("budget spent: stopping", flush=True)
                break
            keep(measure(name, variant, length, tokens, interpret))
    (out / "kernels.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
