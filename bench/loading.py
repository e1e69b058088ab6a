"""Loading a ~1B-parameter preset, Keras and Hugging Face formats.

Each load runs in a fresh process (`bench/load_child.py`), which measures its
own peak host RSS (`VmHWM`, not `ru_maxrss`: Linux carries that over from
this process across fork + exec). Variants: keras-hub onto one device, keras-hub
in a hand-made `ModelParallel` scope with its static Gemma map on `(2, 4)`,
and autodist on `(1, 8)` with `tp` and on `(2, 4)` with `fsdp`. The last two
children only read the weight file, for the floors (`bench/file_reads.py`).
A load is timed in children that sample nothing, and its memory measured in
one more child that samples the devices' bytes as it loads. Bfloat16
presets of 6 and of 12 layers give the steering check: what the 6 more
layers add to the load, against what they add to each floor's read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from bench.file_reads import FILE_READS

CONFIG = dict(
    vocabulary_size=32000,
    num_layers=12,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=2048,
    intermediate_dim=16384,
    head_dim=256,
)
VARIANTS = [
    "keras-hub one device",
    "keras-hub hand-made scope (2,4)",
    "autodist (1,8) tp",
    "autodist (2,4) fsdp",
    "read the file only",
    "read the file, keeping every tensor",
]
BFLOAT16_VARIANTS = [
    "autodist (1,8) tp dtype=bfloat16",
    "autodist (1,8) tp float32 model",
    "read the file only",
    "read the file, keeping every tensor",
]
# A Hugging Face checkpoint's third floor: keras-hub's converter transposes
# its linear weights, which the plain floors do not pay.
TRANSFORMERS_BFLOAT16_VARIANTS = BFLOAT16_VARIANTS + [
    "read the file, keeping every tensor in Keras' layout"
]
# Each floor → the most a bfloat16 load may take, in that floor's reads.
FLOOR_BOUNDS = {
    "read the file only": 3.0,
    "read the file, keeping every tensor": 1.5,
    "read the file, keeping every tensor in Keras' layout": 1.5,
}
# The bfloat16 loads are short next to this machine's noise: their variants
# run this many times, in turn, and each keeps its fastest run.
BFLOAT16_ROUNDS = 3


# The steering check: what 6 more layers add to a bfloat16 Keras preset's
# load, against what they add to each floor's read of its file.
MARGINAL_FORMAT = "keras bfloat16, by layers"
MARGINAL_LAYERS = (6, 12)
MARGINAL_LOAD = "autodist (1,8) tp dtype=bfloat16"
# Each floor the added load is held to (no Keras layout in a Keras preset).
MARGINAL_FLOORS = {
    floor: FLOOR_BOUNDS[floor]
    for floor in ("read the file only", "read the file, keeping every tensor")
}
MARGINAL_VARIANTS = [MARGINAL_LOAD, *MARGINAL_FLOORS]


def save_keras_preset(root: str, config: dict = CONFIG, dtype: str = "float32") -> str:
    """A Gemma preset in Keras format (`config`: `GemmaBackbone` arguments)."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    name = "gemma_1b_keras" if dtype == "float32" else f"gemma_1b_keras_{dtype}"
    path = os.path.join(root, name)
    keras_hub.models.GemmaBackbone(**config, dtype=dtype).save_to_preset(path)
    return path


def save_bfloat16_preset(root: str) -> str:
    """The Keras preset's shapes, saved in bfloat16."""
    return save_keras_preset(root, dtype="bfloat16")


def save_transformers_preset(
    root: str, config: dict = CONFIG, dtype: str = "float32"
) -> str:
    """The same shapes as a Hugging Face Gemma checkpoint, written by hand
    (`dtype`: the tensors' and `torch_dtype`'s)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    stored = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

    c = config
    d, heads, kv, hd = (
        c["hidden_dim"],
        c["num_query_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    ffw = c["intermediate_dim"] // 2
    name = "gemma_1b_transformers"
    path = os.path.join(root, name if dtype == "float32" else f"{name}_{dtype}")
    os.makedirs(path, exist_ok=True)
    config = {
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "vocab_size": c["vocabulary_size"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": d,
        "intermediate_size": ffw,
        "head_dim": hd,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "torch_dtype": dtype,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(stored)

    tensors = {"model.embed_tokens.weight": weight(c["vocabulary_size"], d)}
    tensors["model.norm.weight"] = weight(d)
    for i in range(c["num_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": weight(heads * hd, d),
                p + "self_attn.k_proj.weight": weight(kv * hd, d),
                p + "self_attn.v_proj.weight": weight(kv * hd, d),
                p + "self_attn.o_proj.weight": weight(d, heads * hd),
                p + "mlp.gate_proj.weight": weight(ffw, d),
                p + "mlp.up_proj.weight": weight(ffw, d),
                p + "mlp.down_proj.weight": weight(d, ffw),
                p + "input_layernorm.weight": weight(d),
                p + "post_attention_layernorm.weight": weight(d),
            }
        )
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def _child(path: str, variant: str, timed: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["KERAS_HUB_AUTODIST_PROGRESS"] = "0"
    if FILE_READS.get(variant, {}).get("keep"):
        # The strongest plain floor: numpy's transparent-huge-page advice
        # stalls on memory compaction here when fresh memory is kept.
        env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    result = subprocess.run(
        [sys.executable, "-m", "bench.load_child", path, variant]
        + (["--timed"] if timed else []),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def save_transformers_bfloat16_preset(root: str) -> str:
    """The Hugging Face checkpoint's shapes, in bfloat16."""
    return save_transformers_preset(root, dtype="bfloat16")


def _fastest(jobs: list[tuple], rounds: int) -> dict:
    """Each `(key, path, variant)` of `jobs` `rounds` times, in turn,
    unsampled: the fastest run of each, by key."""
    fastest = {}
    for _ in range(rounds):
        for key, path, variant in jobs:
            row = _child(path, variant, timed=True)
            if key not in fastest or row["load_s"] < fastest[key]["load_s"]:
                fastest[key] = row
    return fastest


def _fastest_runs(path: str, variants: list[str], rounds: int) -> list[dict]:
    """Each variant `rounds` times, in turn, unsampled; the fastest run of
    each, with the memory of one more, sampled, run of each loader (the
    file reads sample nothing)."""
    fastest = _fastest([(v, path, v) for v in variants], rounds)
    rows = []
    for variant in variants:
        memory = {} if variant in FILE_READS else _child(path, variant)
        rows.append({**memory, **fastest[variant], "runs": rounds})
    return rows


def marginal_rows(root: str) -> list[dict]:
    """The steering check: bfloat16 Keras presets of each of
    `MARGINAL_LAYERS` layers, each loaded as bfloat16 and read by each of
    `MARGINAL_FLOORS`, interleaved, the fastest of `BFLOAT16_ROUNDS` runs of
    each. What the more layers add to the load, against what they add to a
    read, leaves out what any load pays once (imports, the model's build,
    first compiles)."""
    paths = {
        layers: save_keras_preset(
            os.path.join(root, f"{layers}_layers"),
            {**CONFIG, "num_layers": layers},
            dtype="bfloat16",
        )
        for layers in MARGINAL_LAYERS
    }
    jobs = [
        ((layers, variant), path, variant)
        for layers, path in paths.items()
        for variant in MARGINAL_VARIANTS
    ]
    fastest = _fastest(jobs, BFLOAT16_ROUNDS)
    for path in paths.values():
        shutil.rmtree(os.path.dirname(path))
    return [
        {"format": MARGINAL_FORMAT, "layers": layers, **row, "runs": BFLOAT16_ROUNDS}
        for (layers, _), row in fastest.items()
    ]


def run(root: str) -> list[dict]:
    rows = []
    for format, save, variants, rounds in (
        ("keras", save_keras_preset, VARIANTS, 1),
        ("transformers", save_transformers_preset, VARIANTS, 1),
        ("keras bfloat16", save_bfloat16_preset, BFLOAT16_VARIANTS, BFLOAT16_ROUNDS),
        (
            "transformers bfloat16",
            save_transformers_bfloat16_preset,
            TRANSFORMERS_BFLOAT16_VARIANTS,
            BFLOAT16_ROUNDS,
        ),
    ):
        path = save(root)
        print(f"  {format}: {', '.join(variants)} ({rounds} x)", flush=True)
        rows += [
            {"format": format, **row} for row in _fastest_runs(path, variants, rounds)
        ]
        shutil.rmtree(path)  # the disk holds one preset at a time
    print(f"  {MARGINAL_FORMAT}: {MARGINAL_LAYERS} layers", flush=True)
    return rows + marginal_rows(root)
