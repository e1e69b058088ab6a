"""A converter's reshape-and-transpose hook, applied slice by slice
(`loading/hook_views.py`), against the hook applied to the whole tensor."""

import concurrent.futures
import itertools

import hf_checkpoints
import keras
import keras_hub
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import keras_hub_autodist
from keras_hub_autodist.loading import session as loading_session
from keras_hub_autodist.loading.hook_views import HookView
from keras_hub_autodist.loading.hook_views import TracedTensor
from keras_hub_autodist.loading.hook_views import trace_hook
from keras_hub_autodist.loading.lazy_tensors import LazySafetensor
from keras_hub_autodist.loading.lazy_tensors import SafetensorsFile

HEADS, HEAD_DIM, HIDDEN = 4, 6, 10

# keras-hub's Gemma and Llama hooks, and other plain moves of axes:
# name -> (tensor, hook, Keras shape).
HOOKS = {
    "query": (
        "in",
        lambda x, s: np.transpose(np.reshape(x, (s[0], s[2], s[1])), axes=(0, 2, 1)),
        [HEADS, HIDDEN, HEAD_DIM],
    ),
    "output": (
        "out",
        lambda x, s: np.transpose(np.reshape(x, (s[2], s[0], s[1])), axes=(1, 2, 0)),
        [HEADS, HEAD_DIM, HIDDEN],
    ),
    "transpose": ("in", lambda x, _: np.transpose(x, axes=(1, 0)), [HIDDEN, 24]),
    "T": ("in", lambda x, _: x.T, [HIDDEN, 24]),
    "reshape method": ("in", lambda x, s: x.reshape(s), [HEADS, HEAD_DIM, HIDDEN]),
    "flatten": ("in", lambda x, _: np.reshape(x, -1), [24 * HIDDEN]),
    "split and swap": (
        "in",
        lambda x, _: x.reshape(2, 12, 2, 5).transpose(2, 0, 3, 1),
        [2, 2, 5, 12],
    ),
}
# Hooks that need the values: traced to `None`, then applied to them.
VALUE_HOOKS = {
    "scale": ("in", lambda x, _: np.transpose(x) * 2, [HIDDEN, 24]),
    "astype": ("in", lambda x, _: x.astype("float32").T, [HIDDEN, 24]),
    "stack": ("in", lambda x, _: np.stack([x, x]), [2, 24, HIDDEN]),
    "wrong shape": ("in", lambda x, _: np.transpose(x), [24, HIDDEN]),
}


@pytest.fixture(scope="module")
def weight_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {
        "in": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(
            ml_dtypes.bfloat16
        ),
        "out": rng.standard_normal((HIDDEN, HEADS * HEAD_DIM)).astype(np.float32),
    }
    path = tmp_path_factory.mktemp("hooks") / "model.safetensors"
    save_file(tensors, str(path))
    executor = concurrent.futures.ThreadPoolExecutor(2)
    with SafetensorsFile(path) as file:
        file.executor = executor
        yield file
    executor.shutdown()


def splits(size: int, parts: int) -> list[slice]:
    return [slice(i * size // parts, (i + 1) * size // parts) for i in range(parts)]


def indices_of(shape) -> list[list[tuple]]:
    """Ways to split a tensor of `shape` among devices: along each axis,
    along two axes at once, and whole."""
    ways = [[tuple(slice(None) for _ in shape)]]
    for axis, size in enumerate(shape):
        for parts in sorted({2, 3, size}):
            ways.append(
                [
                    tuple(s if a == axis else slice(None) for a in range(len(shape)))
                    for s in splits(size, min(parts, size))
                ]
            )
    for first, second in itertools.combinations(range(len(shape)), 2):
        ways.append(
            [
                tuple(
                    a if i == first else b if i == second else slice(None)
                    for i in range(len(shape))
                )
                for a in splits(shape[first], 2)
                for b in splits(shape[second], 2)
            ]
        )
    return ways


@pytest.mark.parametrize("name", sorted(HOOKS))
@pytest.mark.parametrize("threads", [False, True])
def test_every_slice_matches_the_hook_on_the_whole_tensor(weight_file, name, threads):
    key, hook, keras_shape = HOOKS[name]
    expected = hook(weight_file.read(key), keras_shape)
    lazy = LazySafetensor(weight_file, key)
    ops = trace_hook(hook, lazy, keras_shape)
    assert ops is not None
    view = HookView(lazy, ops)
    assert view.shape == tuple(keras_shape) and view.dtype == lazy.dtype
    executor = weight_file.executor if threads else None
    for indices in indices_of(keras_shape):
        for index, value in zip(indices, view.read_slices(indices, executor)):
            np.testing.assert_array_equal(value, expected[index])
        # Cast as read, into given outputs.
        outputs = [np.empty(expected[i].shape, np.float32) for i in indices]
        got = view.read_slices(indices, executor, np.float32, outputs)
        assert all(a is b for a, b in zip(got, outputs))
        for index, value in zip(indices, got):
            np.testing.assert_array_equal(value, expected[index].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(view), expected)


@pytest.mark.parametrize("name", sorted(VALUE_HOOKS))
def test_a_hook_that_needs_values_is_not_traced(weight_file, name):
    key, hook, keras_shape = VALUE_HOOKS[name]
    assert trace_hook(hook, LazySafetensor(weight_file, key), keras_shape) is None


def test_a_traced_tensor_holds_no_values():
    traced = TracedTensor((2, 3), "float32")
    for operation in (
        lambda: np.asarray(traced),
        lambda: traced + 1,
        lambda: np.add(traced, 1),
        lambda: np.concatenate([traced, traced]),
        lambda: traced.reshape(4, 2, order="F"),
    ):
        with pytest.raises(TypeError):
            operation()
    with pytest.raises(ValueError, match="cannot reshape"):
        traced.reshape(4, 2)
    assert traced.reshape(-1, 2).transpose().shape == (2, 3)
    assert traced.T.ops == (("transpose", (1, 0)),)


def test_hooks_that_need_values_still_load_right(tmp_path, monkeypatch):
    """A converter hook that computes is applied to the values read whole;
    the others stay lazy, and every weight equals the one-device load."""
    from keras_hub.src.utils.transformers import convert_llama3 as convert_llama

    preset = hf_checkpoints.llama3(tmp_path / "llama")
    reference = {
        v.path: np.asarray(v.value)
        for v in keras_hub.models.Backbone.from_preset(preset).weights
    }
    convert_weights = convert_llama.convert_weights

    def computing_mlp_hooks(backbone, loader, transformers_config):
        port_weight = loader.port_weight

        def port(keras_variable, hf_weight_key, hook_fn=None):
            if hook_fn is not None and "mlp" in hf_weight_key:
                move = hook_fn

                def hook_fn(tensor, shape):
                    return move(tensor, shape) * 1.0  # needs the values

            return port_weight(keras_variable, hf_weight_key, hook_fn)

        loader.port_weight = port
        return convert_weights(backbone, loader, transformers_config)

    monkeypatch.setattr(convert_llama, "convert_weights", computing_mlp_hooks)
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    backbone = keras_hub.models.Backbone.from_preset(preset, device_mesh=mesh)
    for variable in backbone.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), reference[variable.path]
        )
    stats = keras_hub_autodist.load_stats(backbone)
    assert stats.bytes_received > 0 and stats.bytes_read > 0
    assert loading_session.active_sessions() == 0


@pytest.mark.parametrize("kept_bytes,kept", [(1024**2, True), (16, False)])
def test_a_reading_thread_keeps_only_a_small_scratch_buffer(
    weight_file, monkeypatch, kept_bytes, kept
):
    from keras_hub_autodist.loading import hook_views

    monkeypatch.setattr(hook_views, "KEPT_SCRATCH_BYTES", kept_bytes)
    key, hook, keras_shape = HOOKS["query"]
    lazy = LazySafetensor(weight_file, key)
    view = HookView(lazy, trace_hook(hook, lazy, keras_shape))
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        np.testing.assert_array_equal(
            view.read_slices([(slice(0, 2),)], executor)[0],
            hook(weight_file.read(key), keras_shape)[:2],
        )
        buffer = executor.submit(lambda: getattr(hook_views._scratch, "buffer", None))
        assert (buffer.result() is not None) == kept
    # The calling thread keeps none when it read by itself.
    view.read_slices([(slice(0, 2),)])
    assert getattr(hook_views._scratch, "buffer", None) is None
