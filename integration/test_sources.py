"""Presets from every source, offline, against the real client libraries."""

import json
import os
import shutil
import subprocess
import sys

import hf_checkpoints
import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_autodist
from keras_hub_autodist import pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["gemma", "gemma2", "gemma3_text", "llama3"]
KERAS_BUILDERS = {
    "gemma": "gemma_mqa",
    "gemma2": "gemma2_gqa",
    "gemma3_text": "gemma3_text",
    "llama3": "llama3_untied",
}


def logits(backbone, x):
    return np.asarray(backbone.token_embedding(backbone(x), reverse=True))


def token_batch(vocabulary_size):
    ids = (
        np.random.default_rng(0)
        .integers(1, vocabulary_size, size=(8, 8))
        .astype("int32")
    )
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: write(root / name) for name, write in hf_checkpoints.WRITERS.items()}


def _files_read_before_planning(monkeypatch, preset):
    """Load with a mesh, recording the preset files requested before planning."""
    preset_utils = sys.modules["keras_hub.src.utils.preset_utils"]
    requested, planned = [], []
    real_get_file, real_plan = preset_utils.get_file, pipeline.plan_model

    def get_file(preset_, path):
        if not planned:
            requested.append(path)
        return real_get_file(preset_, path)

    def plan_model(*args, **kwargs):
        planned.append(True)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(preset_utils, "get_file", get_file)
    monkeypatch.setattr(pipeline, "plan_model", plan_model)
    backbone = keras_hub.models.Backbone.from_preset(
        preset, device_mesh={"batch": 2, "model": 4}
    )
    return backbone, requested


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["keras", "transformers"])
def test_local_folders_give_the_same_logits(
    family, fmt, hf_folders, tiny_presets_dir, monkeypatch
):
    preset = (
        hf_folders[family]
        if fmt == "transformers"
        else tiny_presets_dir[KERAS_BUILDERS[family]]
    )
    sharded, requested = _files_read_before_planning(monkeypatch, preset)
    assert set(requested) == {"config.json"}
    monkeypatch.undo()
    single = keras_hub.models.Backbone.from_preset(preset)
    x = token_batch(single.vocabulary_size)
    np.testing.assert_allclose(logits(sharded, x), logits(single, x), atol=1e-5)
    plan = keras_hub_autodist.distribution_of(sharded).plan
    assert any(axis == "model" for row in plan.rows for axis in row.spec)


def test_a_folder_with_only_config_json_plans(hf_folders, tmp_path):
    shutil.copy(
        os.path.join(hf_folders["llama3"], "config.json"), tmp_path / "config.json"
    )
    plan = keras_hub_autodist.plan(str(tmp_path), {"batch": 2, "model": 4})
    assert plan.backbone_class == "Llama3Backbone"


def _run_compare(preset, env):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "compare_logits.py"),
            preset,
            "batch=2,model=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
        env={
            **os.environ,
            **env,
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        },
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _hf_cache_repo(hf_home, repo_id, source):
    """Lay out `source` as a snapshot in a Hugging Face cache."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    sha = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(source, repo / "snapshots" / sha)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)


@pytest.mark.parametrize("fmt", ["keras", "transformers"])
def test_hf_handles_from_an_offline_cache(fmt, tmp_path, hf_folders, tiny_presets_dir):
    source = (
        hf_folders["llama3"] if fmt == "transformers" else tiny_presets_dir["gemma_mqa"]
    )
    _hf_cache_repo(tmp_path, f"someone/tiny-{fmt}", source)
    out = _run_compare(
        f"hf://someone/tiny-{fmt}",
        {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert out["max_abs_diff"] <= 1e-5 and out["sharded_weights"] > 0


def test_kaggle_handle_from_kagglehub_cache_without_network(tmp_path, tiny_presets_dir):
    # kagglehub has no offline switch and keras-hub probes optional files
    # (task.weights.h5) over the network: with a fully cached preset and no
    # network, from_preset(device_mesh=...) loads from kagglehub's cache.
    script = f"""
import os, shutil, sys
from kagglehub import cache
from kagglehub.handle import parse_model_handle
handle = parse_model_handle("someone/tiny-gemma/keras/mqa/1")
src = {tiny_presets_dir["gemma_mqa"]!r}
for root, _, files in os.walk(src):
    for f in files:
        name = os.path.relpath(os.path.join(root, f), src)
        dst = cache.get_cached_path(handle, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(os.path.join(src, name), dst)
        cache.Cache().mark_as_complete(handle, name)
"""
    env = {**os.environ, "KAGGLEHUB_CACHE": str(tmp_path / "kaggle")}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    out = _run_compare(
        "kaggle://someone/tiny-gemma/keras/mqa/1",
        {"KAGGLEHUB_CACHE": env["KAGGLEHUB_CACHE"]},
    )
    assert out["max_abs_diff"] <= 1e-5 and out["backbone"] == "GemmaBackbone"


def test_cached_kaggle_snapshot_needs_a_versioned_cached_handle(tmp_path, monkeypatch):
    from keras_hub_autodist.reading.loaders import cached_kaggle_snapshot

    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path))
    assert cached_kaggle_snapshot("kaggle://someone/tiny/keras/v") is None
    assert cached_kaggle_snapshot("kaggle://someone/tiny/keras/v/1") is None
    assert cached_kaggle_snapshot(str(tmp_path)) is None
    assert keras.distribution.distribution() is None
