"""A model on a mesh against the same model on one device.

`assert_same_training` trains a preset for a few steps with `device_mesh=`
and again without it, on the same batch, and asserts that the losses (and,
under SGD, the weights) are equal, that every weight is laid out as the plan
says, and that nothing was left in Keras' global distribution. The
single-device run of each preset, optimizer, step count and batch is made
once per session.

Example:

```python
lm = assert_same_training(preset, "sgd", device_mesh={"batch": 2, "model": 4})
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re

import keras
import keras_hub
import numpy as np
import tiny_presets
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

import keras_hub_autodist

BATCH_SIZE = 8
# The meshes of the 8 virtual devices: each axis order, and a 3D one.
MESHES_2D = [(8, 1), (4, 2), (2, 4), (1, 8)]
MESHES = (
    [{"batch": b, "model": m} for b, m in MESHES_2D]
    + [{"model": m, "batch": b} for b, m in MESHES_2D]
    + [{"batch": 2, "model": 2, "x": 2}]
)


def mesh_id(mesh: dict) -> str:
    """A test id for a mesh: `{"batch": 2, "model": 4}` -> `batch2-model4`."""
    return "-".join(f"{k}{v}" for k, v in mesh.items())


STRATEGIES = ("tp", "fsdp")
OPTIMIZERS = ("sgd", "adam")


def pairwise_cases(names, meshes, skip=()) -> list[tuple]:
    """`(name, mesh, strategy, optimizer)` runs: every name on every mesh once,
    the strategy and optimizer turning so that every pair of values of any
    two of the four factors is trained (a pairwise design: one run per name
    and mesh instead of four), less the cases in `skip` (runs the default
    session already makes, as `(name, mesh_id, strategy, optimizer)`).

    A failure tied to one value, or to two values together, shows in some
    run; what only three values together would break is not looked for.
    `assert_covers_every_pair` checks the cover.

    Example:
    ```python
    for name, mesh, strategy, optimizer in pairwise_cases(PRESETS, MESHES):
        assert_same_training(preset, optimizer, device_mesh=mesh, strategy=strategy)
    ```
    """
    cases = []
    for i, name in enumerate(names):
        for j, mesh in enumerate(meshes):
            strategy = STRATEGIES[(i + j) % 2]
            optimizer = OPTIMIZERS[(i + j // 2) % 2]
            if (name, mesh_id(mesh), strategy, optimizer) not in set(skip):
                cases.append((name, mesh, strategy, optimizer))
    return cases


def assert_covers_every_pair(names, meshes) -> None:
    """`pairwise_cases(names, meshes)` trains every pair of values."""
    cases = [
        (name, mesh_id(mesh), strategy, optimizer)
        for name, mesh, strategy, optimizer in pairwise_cases(names, meshes)
    ]
    values = (list(names), [mesh_id(m) for m in meshes], STRATEGIES, OPTIMIZERS)
    for a, b in itertools.combinations(range(4), 2):
        covered = {(case[a], case[b]) for case in cases}
        assert covered == set(itertools.product(values[a], values[b])), (a, b)


def optimizer_for(name: str) -> keras.optimizers.Optimizer:
    """SGD or Adam, built before `compile` as a user would build it."""
    # Built before compile on purpose: its iteration/learning-rate variables
    # then live on one device (the "incompatible devices" report).
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(1e-2)


def vocabulary_size(preset: str) -> int:
    """The vocabulary size in a preset's config.json (Keras or Hugging Face)."""
    with open(os.path.join(preset, "config.json")) as f:
        config = json.load(f)
    config = config.get("config", config)
    return config.get("vocabulary_size") or config["vocab_size"]


def batch_for(
    preset: str,
    *,
    batch_size: int = BATCH_SIZE,
    sequence_length: int = 8,
    seed: int = 0,
    position_ids: bool = False,
) -> tuple[dict, np.ndarray]:
    """Token ids for `preset` and their next-token labels.

    Args:
        preset: a preset folder; its vocabulary size bounds the ids.
        batch_size: the number of sequences.
        sequence_length: the tokens per sequence.
        seed: the seed of the ids.
        position_ids: also give `position_ids` (Gemma 4 takes them).
    """
    x = tiny_presets.token_batch(
        batch_size, vocabulary_size(preset), sequence_length, seed=seed
    )
    if position_ids:
        positions = np.arange(sequence_length, dtype="int32")
        x["position_ids"] = np.broadcast_to(positions, x["token_ids"].shape).copy()
    return x, np.roll(x["token_ids"], -1, axis=1)


@dataclasses.dataclass
class Training:
    """A trained model, its loss at each step and its weights in model order."""

    model: keras.Model
    losses: list
    weights: list


def train(
    preset: str,
    optimizer: str = "sgd",
    *,
    task=keras_hub.models.CausalLM,
    batch=None,
    steps: int = 3,
    **from_preset_kwargs,
) -> Training:
    """Load `preset` with `task.from_preset` and train it on one batch.

    Args:
        preset: a preset folder.
        optimizer: `"sgd"` or `"adam"`.
        task: the task class to load with.
        batch: `(x, y)`; `batch_for(preset)` by default.
        steps: the number of `train_on_batch` steps.
        **from_preset_kwargs: e.g. `device_mesh=`, `strategy=`.
    """
    lm = task.from_preset(preset, preprocessor=None, **from_preset_kwargs)
    lm.compile(
        optimizer=optimizer_for(optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    x, y = batch if batch is not None else batch_for(preset)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(steps)
    ]
    weights = [(w.path, np.asarray(w.value)) for w in lm.backbone.weights]
    return Training(lm, losses, weights)


_references = {}


def _batch_key(batch) -> str | None:
    if batch is None:
        return None
    x, y = batch
    digest = hashlib.sha256(np.asarray(y).tobytes())
    for name in sorted(x):
        digest.update(name.encode() + np.asarray(x[name]).tobytes())
    return digest.hexdigest()


def reference(
    preset, optimizer="sgd", *, task=keras_hub.models.CausalLM, batch=None, steps=3
) -> Training:
    """The single-device `train` of these arguments, made once per session."""
    key = (preset, optimizer, task, steps, _batch_key(batch))
    if key not in _references:
        _references[key] = train(preset, optimizer, task=task, batch=batch, steps=steps)
    return _references[key]


def step_state(model) -> tuple:
    """The state a bound model's `train_step` takes, as Keras' JAX trainer
    passes it: trainable, non-trainable, optimizer and metric values."""
    return tuple(
        [v.value for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )


def without_counters(path: str) -> str:
    """A variable path without keras-hub's process-wide layer counters.

    keras-hub numbers MoE blocks (and Qwen-MoE's dense MLPs) per process, so
    two builds of one model name them differently.
    """
    return re.sub(r"(moe_block|moe_mlp)_\d+", r"\1", path)


def assert_same_training(
    preset: str,
    optimizer: str = "sgd",
    *,
    task=keras_hub.models.CausalLM,
    batch=None,
    steps: int = 3,
    atol: float = 1e-5,
    **mesh_kwargs,
) -> keras.Model:
    """Training with `mesh_kwargs` equals training on one device.

    The losses agree to `rtol=1e-5`; under SGD every weight agrees to
    `atol`, in model order (Adam's first steps amplify rounding, so only its
    losses are compared). Every weight is laid out as planned, and Keras'
    global distribution is left unset.

    Args:
        preset: a preset folder.
        optimizer: `"sgd"` or `"adam"`.
        task: the task class to load with.
        batch: `(x, y)`; `batch_for(preset)` by default.
        steps: the number of training steps.
        atol: the tolerance of the weights.
        **mesh_kwargs: `device_mesh=` and the other options of `from_preset`.

    Returns:
        The model trained on the mesh.
    """
    run = train(preset, optimizer, task=task, batch=batch, steps=steps, **mesh_kwargs)
    single = reference(preset, optimizer, task=task, batch=batch, steps=steps)
    np.testing.assert_allclose(run.losses, single.losses, rtol=1e-5)
    if optimizer == "sgd":
        assert [without_counters(p) for p, _ in run.weights] == [
            without_counters(p) for p, _ in single.weights
        ]
        for (path, value), (_, expected) in zip(run.weights, single.weights):
            np.testing.assert_allclose(value, expected, atol=atol, err_msg=path)
    assert_laid_out_as_planned(run.model)
    assert keras.distribution.distribution() is None
    return run.model


def assert_laid_out_as_planned(model, mesh=None) -> None:
    """Every weight of a bound model is sharded as its plan row says.

    Rows are matched to weights by path, without keras-hub's layer counters
    (the plan's paths may come from another build than the model's).

    Args:
        model: a bound Backbone or Task.
        mesh: the `keras.distribution.DeviceMesh` the weights must be on;
            the model's own by default.
    """
    distribution, plan = keras_hub_autodist.distribution_of(model)
    mesh = mesh if mesh is not None else distribution.device_mesh
    backbone = getattr(model, "backbone", model)
    rows = {without_counters(row.path): row for row in plan.rows}
    assert set(rows) == {without_counters(v.path) for v in backbone.weights}
    for variable in backbone.weights:
        row = rows[without_counters(variable.path)]
        expected = NamedSharding(mesh.backend_mesh, PartitionSpec(*row.spec))
        actual = variable.value.sharding
        assert actual.is_equivalent_to(expected, len(variable.shape)), (
            variable.path,
            actual,
            expected,
        )


def padded_spec(variable) -> tuple:
    """A variable's partition spec, one entry per dimension."""
    spec = tuple(variable.value.sharding.spec)
    return spec + (None,) * (len(variable.shape) - len(spec))


def assert_lora_kernels_follow_their_kernels(lm) -> tuple[list, int]:
    """Each LoRA layer's `lora_kernel_a` is split like its kernel's input
    dimensions and `lora_kernel_b` like its output dimension, so that
    `a @ b` is laid out like the kernel.

    Keras has no public way to list nested layers or reach a LoRA layer's
    kernel variable (`kernel` is the merged tensor): `_flatten_layers` and
    `_kernel` are used here.

    Returns:
        The LoRA-enabled layers, and how many of them have a sharded lora
        kernel.
    """
    with_lora = [
        layer
        for layer in lm.backbone._flatten_layers()
        if getattr(layer, "lora_enabled", False)
    ]
    sharded = 0
    for layer in with_lora:
        kernel = padded_spec(layer._kernel)
        a, b = padded_spec(layer.lora_kernel_a), padded_spec(layer.lora_kernel_b)
        assert a == kernel[:-1] + (None,), (layer.lora_kernel_a.path, a, kernel)
        assert b == (None, kernel[-1]), (layer.lora_kernel_b.path, b, kernel)
        sharded += any(axis is not None for axis in a + b)
    return with_lora, sharded


def greedy_tokens(lm, preset: str) -> np.ndarray:
    """Greedy `generate` from 3-token prompts of `batch_for(preset, seed=1)`."""
    x, _ = batch_for(preset, seed=1)
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :3] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    out = lm.generate(prompt, max_length=8, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def assert_same_generate(
    preset: str, mesh, task=keras_hub.models.CausalLM, **from_preset_kwargs
) -> None:
    """Greedy `generate` of `task` on `mesh` gives the single-device tokens."""
    models = []
    for kwargs in ({}, {"device_mesh": mesh, **from_preset_kwargs}):
        lm = task.from_preset(preset, preprocessor=None, **kwargs)
        lm.compile(sampler="greedy")
        models.append(lm)
    single, sharded = models
    np.testing.assert_array_equal(
        greedy_tokens(sharded, preset), greedy_tokens(single, preset)
    )


def weight_layouts(plan) -> dict[str, tuple]:
    """The weight keys of the `LayoutMap` Keras gets from `plan`, and their
    axes (without the layer-output keys), on the first devices."""
    axes = plan.mesh_axes
    devices = keras.distribution.list_devices()[: axes.num_devices]
    mesh = keras.distribution.DeviceMesh(axes.shape, axes.axis_names, devices)
    activations = plan.activation_layouts()
    return {
        key: tuple(layout.axes)
        for key, layout in plan.layout_map(mesh).items()
        if key not in activations
    }
