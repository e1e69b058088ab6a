"""Planning a 70B preset: the abstract build's time, memory and cache.

Each preset is planned in a fresh process (`python -m bench.planning CHILD
<config.json>`), so imports, time and peak RSS are its own: the child times
importing keras-hub, the first `plan()` (which builds the backbone abstractly
from config.json), a re-plan of the same preset on another mesh (served by
the cache), and counts JAX's live arrays before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

# Llama 3.1 70B and Qwen 2.5 72B, as their Hugging Face config.json files.
CONFIGS = {
    "llama3.1_70b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5_72b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": 70,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
FIRST_MESH = {"batch": 16, "model": 16}
SECOND_MESH = {"batch": 8, "model": 32}


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: per address space, fresh after exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(folder: str) -> dict:
    import time

    start = time.perf_counter()
    import jax
    import keras_hub  # noqa: F401

    import keras_hub_autodist

    imported = time.perf_counter() - start
    arrays_before = len(jax.live_arrays())
    start = time.perf_counter()
    first = keras_hub_autodist.plan(folder, FIRST_MESH, dtype="bfloat16")
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    keras_hub_autodist.plan(folder, SECOND_MESH, dtype="bfloat16")
    replan_s = time.perf_counter() - start
    return dict(
        import_s=imported,
        first_plan_s=first_s,
        replan_s=replan_s,
        params=first.num_parameters,
        peak_rss=_peak_rss(),
        live_arrays=len(jax.live_arrays()) - arrays_before,
        architecture=first.architecture,
    )


def run() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, config in CONFIGS.items():
            folder = os.path.join(root, name)
            os.makedirs(folder)
            with open(os.path.join(folder, "config.json"), "w") as file:
                json.dump(config, file)
            done = subprocess.run(
                [sys.executable, "-m", "bench.planning", "CHILD", folder],
                capture_output=True,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )
            if done.returncode != 0:
                last = done.stderr.strip().splitlines()[-1:] or ["?"]
                rows.append(dict(preset=name, error=last[0]))
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(dict(preset=name, **result))
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["CHILD"]:
    os.environ["KERAS_BACKEND"] = "jax"
    print(json.dumps(child(sys.argv[2])))
