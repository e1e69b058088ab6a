"""Load a preset with and without a mesh; print the largest logit difference.

Usage: python compare_logits.py PRESET batch=2,model=4

Run as a subprocess by the hub tests, so that HF_HOME / HF_HUB_OFFLINE /
KAGGLEHUB_CACHE take effect before huggingface_hub and kagglehub start.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_hub_autodist  # noqa: E402


def logits(backbone, x):
    hidden = backbone(x)
    return np.asarray(backbone.token_embedding(hidden, reverse=True))


def main(preset, mesh_text):
    mesh = {k: int(v) for k, v in (p.split("=") for p in mesh_text.split(","))}
    sharded = keras_hub.models.Backbone.from_preset(preset, device_mesh=mesh)
    single = keras_hub.models.Backbone.from_preset(preset)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, single.vocabulary_size, size=(8, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    plan = keras_hub_autodist.distribution_of(sharded).plan
    print(
        json.dumps(
            {
                "max_abs_diff": float(
                    np.abs(logits(sharded, x) - logits(single, x)).max()
                ),
                "backbone": plan.backbone_class,
                "sharded_weights": sum(1 for r in plan.rows if any(r.spec)),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
