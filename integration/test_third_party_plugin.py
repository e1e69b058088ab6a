"""A third-party package adds a family with one rule table, through the
`keras_hub_autodist.architectures` entry points, installed into a fresh venv."""

import subprocess
import sys
import textwrap

import pytest
import venvs

PLUGIN_MODULE = '''
"""A tiny keras-hub backbone and its keras-hub-autodist rule table."""

import keras
import keras_hub

from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import rule_table


@keras.saving.register_keras_serializable(package="toy_family")
class ToyBackbone(keras_hub.models.Backbone):
    def __init__(self, vocabulary_size, hidden_dim, intermediate_dim, **kwargs):
        tokens = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        x = keras.layers.Embedding(vocabulary_size, hidden_dim, name="embed")(tokens)
        x = keras.layers.Dense(intermediate_dim, name="mlp_up")(x)
        x = keras.layers.Dense(hidden_dim, name="mlp_down")(x)
        super().__init__(inputs=tokens, outputs=x, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim

    def get_config(self):
        return {
            **super().get_config(),
            "vocabulary_size": self.vocabulary_size,
            "hidden_dim": self.hidden_dim,
            "intermediate_dim": self.intermediate_dim,
        }


TOY = Architecture(
    name="toy",
    rules=rule_table(
        ("embed/embeddings", ("vocab", "embed")),
        ("mlp_up/kernel", ("embed", "mlp")),
        ("mlp_down/kernel", ("mlp", "embed")),
        ("mlp_(up|down)/bias", ("unsharded",)),
    ),
    config_fields={"vocab": "vocabulary_size", "mlp": "intermediate_dim"},
)
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "toy-family"
version = "0.1"

[project.entry-points."keras_hub_autodist.architectures"]
ToyBackbone = "toy_family:TOY"
"""


@pytest.fixture(scope="module")
def venv_with_plugin(tmp_path_factory):
    python = venvs.fresh_venv(tmp_path_factory)
    source = tmp_path_factory.mktemp("toy_family")
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "toy_family.py").write_text(PLUGIN_MODULE)
    wheels = tmp_path_factory.mktemp("toy_wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels)]
        + [str(source)],
        check=True,
    )
    venvs.pip_install(python, str(next(wheels.glob("toy_family-*.whl"))))
    return python


@pytest.mark.venv
def test_a_plugin_family_plans_in_a_fresh_venv(venv_with_plugin):
    code = textwrap.dedent(
        """
        import os
        os.environ["KERAS_BACKEND"] = "jax"
        import keras_hub_autodist
        from keras_hub_autodist.architectures import registry
        import toy_family

        print("source:", registry.architecture_sources()["ToyBackbone"])
        config = {"vocabulary_size": 64, "hidden_dim": 16, "intermediate_dim": 32}
        plan = keras_hub_autodist.plan(
            {"class_name": "ToyBackbone", "config": config}, {"batch": 2, "model": 4}
        )
        print("architecture:", plan.architecture)
        for row in plan.rows:
            print("row:", row.path, row.shape, row.spec)
        backbone = toy_family.ToyBackbone(**config)
        again = keras_hub_autodist.plan(backbone, {"batch": 1, "model": 8})
        print("instance:", again.architecture, len(again.rows))
        """
    )
    done = venvs.run(venv_with_plugin, code)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "source: plugin toy-family" in out
    assert "architecture: toy" in out
    assert "row: embed/embeddings (64, 16) ('model', None)" in out
    assert "row: mlp_up/kernel (16, 32) (None, 'model')" in out
    assert "row: mlp_down/kernel (32, 16) ('model', None)" in out
    assert "row: mlp_up/bias (32,) (None,)" in out
    assert "instance: toy 5" in out
