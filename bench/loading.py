"""Peak host RSS and per-device bytes while loading a ~1B-parameter preset.

Each load runs in its own process (so ru_maxrss is its own); a thread samples
the bytes of live JAX arrays on every device during the load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CONFIG = dict(
    vocabulary_size=32000,
    num_layers=12,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=2048,
    intermediate_dim=16384,
    head_dim=256,
)

CHILD = r"""
import json, os, resource, sys, threading, time
os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, keras, keras_hub, keras_hub_autodist
path, variant = sys.argv[1], sys.argv[2]
peak = {}
stop = False
def sample():
    while not stop:
        per_device = {}
        for array in jax.live_arrays():
            try:
                for shard in array.addressable_shards:
                    key = str(shard.device)
                    per_device[key] = per_device.get(key, 0) + shard.data.nbytes
            except Exception:
                pass
        for key, value in per_device.items():
            peak[key] = max(peak.get(key, 0), value)
        time.sleep(0.02)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), keras.distribution.list_devices())
start = time.perf_counter()
if variant.startswith("autodist"):
    strategy = variant.split()[-1]
    t = time.perf_counter()
    plan = keras_hub_autodist.plan(path, mesh, strategy=strategy)
    plan_s = time.perf_counter() - t
    backbone = keras_hub.models.Backbone.from_preset(path, device_mesh=mesh, strategy=strategy)
else:
    plan_s = 0.0
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        backbone = keras_hub.models.Backbone.from_preset(path)
load_s = time.perf_counter() - start
stop = True
thread.join()
final = {}
largest = 0
for w in backbone.weights:
    largest = max(largest, w.value.nbytes)
    for shard in w.value.addressable_shards:
        final[str(shard.device)] = final.get(str(shard.device), 0) + shard.data.nbytes
print(json.dumps(dict(variant=variant, load_s=load_s, plan_s=plan_s,
    peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    peak_device=max(peak.values()), peak_device_name=max(peak, key=peak.get),
    final_device=max(final.values()), largest_weight=largest,
    params=backbone.count_params())))
"""


def save_preset(root):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    path = os.path.join(root, "gemma_1b")
    keras_hub.models.GemmaBackbone(**CONFIG).save_to_preset(path)
    return path


def run(root):
    path = save_preset(root)
    rows = []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for variant in ["autodist auto", "autodist fsdp", "hand-made scope"]:
        result = subprocess.run(
            [sys.executable, "-c", CHILD, path, variant],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return rows
