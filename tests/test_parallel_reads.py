"""Weight files read by offset: slices bitwise equal to numpy's, read on a
pool of threads, and a narrower file dtype cast once: on the devices of an
accelerator, by the reading threads on CPU."""

import concurrent.futures
import threading

import h5py
import jax
import keras
import keras_hub
import ml_dtypes
import numpy as np
import pytest
import tiny_presets
from test_loading import MEDIUM_GEMMA
from test_loading import backbone_preset
from test_loading import mesh_of
from test_loading import sample_peaks

import keras_hub_autodist
from keras_hub_autodist import devices
from keras_hub_autodist.loading import file_reads
from keras_hub_autodist.loading import lazy_tensors
from keras_hub_autodist.loading import transfer

HEADER = 24  # bytes before the tensor in the file, so offsets are not 0


def write_tensor(path, values):
    with open(path, "wb") as f:
        f.write(b"x" * HEADER)
        f.write(np.ascontiguousarray(values).tobytes())
        f.write(b"y" * 8)


def column_slices(shape, parts, axis):
    size = shape[axis] // parts
    return [
        tuple(
            slice(i * size, (i + 1) * size) if a == axis else slice(None)
            for a in range(len(shape))
        )
        for i in range(parts)
    ]


CASES = [
    # shape, dtype, slices
    ((64, 48), "float32", column_slices((64, 48), 8, 1)),
    ((64, 48), "float32", column_slices((64, 48), 4, 0)),
    ((6, 40, 10), ml_dtypes.bfloat16, column_slices((6, 40, 10), 2, 1)),
    ((6, 40, 10), "int8", column_slices((6, 40, 10), 5, 2)),
    (
        (128, 16),
        "float32",
        [(slice(0, 64), slice(8, 16)), (slice(64, 128), slice(0, 8))],
    ),
    (
        (128, 16),
        "float32",
        [(slice(0, 128), slice(2, 6)), (slice(0, 128), slice(10, 12))],
    ),
    ((50,), "float32", [(slice(0, 25),), (slice(25, 50),), (slice(None),)]),
    ((), "float32", [()]),
    ((0, 4), "float32", [(slice(None), slice(None))]),
]


@pytest.mark.parametrize("threads", [0, 3])
@pytest.mark.parametrize("shape,dtype,indices", CASES)
def test_slices_are_bitwise_numpys(
    tmp_path, monkeypatch, shape, dtype, indices, threads
):
    # Tiny thresholds: long runs split into pieces, short runs read by rows.
    monkeypatch.setattr(file_reads, "READ_CHUNK_BYTES", 96)
    monkeypatch.setattr(file_reads, "SMALL_RUN_BYTES", 64)
    monkeypatch.setattr(file_reads, "SMALL_RUN_COUNT", 4)
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(shape) * 50).astype(dtype)
    path = tmp_path / "tensor.bin"
    write_tensor(path, values)
    executor = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    with file_reads.HeldFile(path) as file:
        tensor = file_reads.ContiguousTensor(file, HEADER, shape, dtype)
        read = tensor.read_slices(indices, executor)
        whole = tensor.read()
    for index, part in zip(indices, read):
        expected = values[index]
        assert part.dtype == expected.dtype and part.shape == expected.shape
        assert part.tobytes() == expected.tobytes(), index
        assert part.size == 0 or part.ctypes.data % file_reads.BUFFER_ALIGNMENT == 0
    assert whole.tobytes() == values.tobytes()


def test_reads_run_on_the_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(file_reads, "READ_CHUNK_BYTES", 1024)
    values = np.arange(64 * 256, dtype="float32").reshape(64, 256)
    path = tmp_path / "tensor.bin"
    write_tensor(path, values)
    threads = set()
    read_into = file_reads.HeldFile.read_into

    def recording_read_into(file, buffer, offset):
        threads.add(threading.current_thread().name)
        return read_into(file, buffer, offset)

    monkeypatch.setattr(file_reads.HeldFile, "read_into", recording_read_into)
    executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="reader")
    with file_reads.HeldFile(path) as file:
        tensor = file_reads.ContiguousTensor(file, HEADER, values.shape, "float32")
        (part,) = tensor.read_slices([(slice(0, 32), slice(None))], executor)
    np.testing.assert_array_equal(part, values[:32])
    assert threads and all(name.startswith("reader") for name in threads)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "tensor.bin"
    write_tensor(path, np.zeros(4, "float32"))
    with file_reads.HeldFile(path) as file:
        tensor = file_reads.ContiguousTensor(file, HEADER, (400,), "float32")
        with pytest.raises(
            keras_hub_autodist.WeightFileChangedError, match="truncated.*Received"
        ):
            tensor.read()


def test_h5_offsets_only_for_plain_contiguous_datasets(tmp_path):
    path = str(tmp_path / "data.h5")
    values = np.arange(60, dtype="float32").reshape(6, 10)
    with h5py.File(path, "w") as f:
        f.create_dataset("plain", data=values)
        f.create_dataset("chunked", data=values, chunks=(2, 10))
        f.create_dataset("compressed", data=values, compression="gzip")
        f.create_dataset("big_endian", data=values.astype(">f4"))
    with h5py.File(path, "r") as f, file_reads.HeldFile(path) as file:
        offset = lazy_tensors.h5_contiguous_offset(f["plain"])
        assert offset is not None
        for name in ("chunked", "compressed", "big_endian"):
            assert lazy_tensors.h5_contiguous_offset(f[name]) is None, name
        for name in ("plain", "chunked", "compressed"):
            lazy = lazy_tensors.LazyH5Dataset(f[name], "float32", file)
            assert (lazy.contiguous is not None) == (name == "plain")
            part = lazy.read_slices([(slice(1, 4), slice(2, 7))])[0]
            np.testing.assert_array_equal(part, values[1:4, 2:7])


@pytest.fixture(params=["cpu", "accelerator"])
def devices_kind(request, monkeypatch):
    """The CPU path, or the accelerator path taken on the CPU devices."""
    if request.param == "accelerator":
        monkeypatch.setattr(transfer, "on_cpu", lambda sharding: False)
    return request.param


def test_a_bfloat16_file_into_a_float32_model_is_cast_once(
    tmp_path, monkeypatch, devices_kind
):
    """Accelerators receive the file's bfloat16 and cast on the devices; on
    CPU the reading threads cast, and the devices receive float32."""
    path = backbone_preset(tmp_path / "bf16", tiny_presets.GEMMA_MQA, dtype="bfloat16")
    single = keras_hub.models.Backbone.from_preset(path, dtype="float32")
    moved = []
    to_devices = transfer.to_devices

    def recording_to_devices(shape, sharding, values):
        moved.extend(np.dtype(v.dtype) for v in values)
        return to_devices(shape, sharding, values)

    monkeypatch.setattr(transfer, "to_devices", recording_to_devices)
    monkeypatch.setattr(transfer, "placeholder", placeholder_without_transfer)
    backbone = keras_hub.models.Backbone.from_preset(
        path, dtype="float32", device_mesh={"batch": 2, "model": 4}
    )
    expected = ml_dtypes.bfloat16 if devices_kind == "accelerator" else "float32"
    assert moved and set(moved) == {np.dtype(expected)}
    stats = keras_hub_autodist.load_stats(backbone)
    assert stats.bytes_read == sum(v.value.nbytes // 2 for v in backbone.weights)
    for mine, theirs in zip(backbone.weights, single.weights):
        assert mine.dtype == "float32"
        assert np.asarray(mine.value).tobytes() == np.asarray(theirs.value).tobytes()


@pytest.mark.parametrize(
    "stored,wanted",
    [
        (ml_dtypes.bfloat16, "float32"),
        ("float16", "float32"),
        ("float32", ml_dtypes.bfloat16),
        ("float32", "float32"),
    ],
)
def test_reads_cast_to_the_dtype_asked(tmp_path, monkeypatch, stored, wanted):
    monkeypatch.setattr(file_reads, "READ_CHUNK_BYTES", 96)
    monkeypatch.setattr(file_reads, "SMALL_RUN_BYTES", 64)
    monkeypatch.setattr(file_reads, "SMALL_RUN_COUNT", 4)
    values = (np.random.default_rng(0).standard_normal((64, 48)) * 50).astype(stored)
    path = tmp_path / "tensor.bin"
    write_tensor(path, values)
    indices = column_slices((64, 48), 8, 1) + column_slices((64, 48), 4, 0)
    executor = concurrent.futures.ThreadPoolExecutor(2)
    with file_reads.HeldFile(path) as file:
        tensor = file_reads.ContiguousTensor(file, HEADER, values.shape, stored)
        read = tensor.read_slices(indices, executor, dtype=wanted)
    for index, part in zip(indices, read):
        expected = values[index].astype(wanted)
        assert part.dtype == expected.dtype
        assert part.tobytes() == expected.tobytes(), index


def placeholder_without_transfer(shape, dtype, sharding, buffers=None):
    """Zeros made on the devices: nothing crosses from the host (the reads
    then fill `buffers`, which no placeholder adopted)."""
    return transfer.device_zeros(
        tuple(shape), transfer.numpy_dtype(dtype).name, sharding
    )()


def test_peak_bytes_per_device_while_casting(tmp_path, monkeypatch, devices_kind):
    """A bfloat16 file into a float32 model: no device holds more than its
    final share + its largest shard, a bfloat16 copy included."""
    path = backbone_preset(tmp_path / "medium", MEDIUM_GEMMA, dtype="bfloat16")
    keras.utils.clear_session(free_memory=True)
    baseline = devices.per_device_bytes()
    peaks, _ = sample_peaks(monkeypatch)
    backbone = keras_hub.models.Backbone.from_preset(
        path, dtype="float32", device_mesh=mesh_of((1, 8)), strategy="tp"
    )
    _, plan = keras_hub_autodist.distribution_of(backbone)
    largest_shard = max(row.device_bytes for row in plan.rows)
    final = devices.per_device_bytes()
    for device, peak in peaks.items():
        share = final.get(device, 0) - baseline.get(device, 0)
        assert share >= plan.max_device_bytes
        grown = peak - baseline.get(device, 0)
        assert grown <= share + largest_shard, (device, grown, share, largest_shard)


def test_load_stats_time_reading_and_transfer(tmp_path):
    path = backbone_preset(tmp_path / "f32", tiny_presets.GEMMA_MQA)
    backbone = keras_hub.models.Backbone.from_preset(
        path, device_mesh={"batch": 2, "model": 4}
    )
    stats = keras_hub_autodist.load_stats(backbone)
    assert stats.read_seconds > 0 and stats.transfer_seconds > 0
    assert stats.read_seconds + stats.transfer_seconds <= stats.seconds
    assert stats.bytes_read == sum(v.value.nbytes for v in backbone.weights)


@pytest.mark.parametrize(
    "axes", [("batch", "model"), (None, "model"), ("batch", None), (None, None)]
)
def test_each_cpu_device_adopts_a_buffer_of_its_own(axes):
    """Sharded, partly and fully replicated: every device's shard is the
    very buffer handed over (no copy), and no two devices share one."""
    mesh = mesh_of((2, 4)).backend_mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
    values = np.arange(4 * 8, dtype="float32").reshape(4, 8)
    indices = sharding.addressable_devices_indices_map(values.shape)
    buffers = {}
    for device, index in indices.items():
        buffers[device] = file_reads.aligned_empty(values[index].shape, "float32")
        buffers[device][...] = values[index]
    array = transfer.to_devices(values.shape, sharding, list(buffers.values()))
    assert np.asarray(array).tolist() == values.tolist()
    assert len(array.addressable_shards) == len(buffers)
    for shard in array.addressable_shards:
        assert shard.data.unsafe_buffer_pointer() == buffers[shard.device].ctypes.data


@pytest.mark.parametrize("threads", [0, 3])
@pytest.mark.parametrize("shape,dtype,indices", CASES)
def test_slices_are_read_into_the_buffers_given(
    tmp_path, shape, dtype, indices, threads
):
    """Into a wider dtype too, and each buffer is filled in place."""
    values = (np.arange(np.prod(shape)) % 251 - 125).astype(dtype).reshape(shape)
    write_tensor(tmp_path / "w.bin", values)
    wanted = np.dtype("float32")
    executor = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    with file_reads.HeldFile(tmp_path / "w.bin") as file:
        tensor = file_reads.ContiguousTensor(file, HEADER, shape, dtype)
        outputs = [
            file_reads.aligned_empty(values[index].shape, wanted, zeros=True)
            for index in indices
        ]
        read = tensor.read_slices(indices, executor, dtype=wanted, outputs=outputs)
        for index, output, part in zip(indices, outputs, read):
            assert part is output
            assert output.tolist() == values[index].astype(wanted).tolist()
        with pytest.raises(ValueError, match="Expected"):
            tensor.read_slices(indices, executor, dtype="float64", outputs=outputs)
        strided = [np.empty(o.shape + (2,), wanted)[..., 0] for o in outputs]
        if any(o.size > 1 for o in outputs):
            with pytest.raises(ValueError, match="strided"):
                tensor.read_slices(indices, executor, dtype=wanted, outputs=strided)


def test_copy_slices_casts_a_transposed_source_into_its_buffers():
    source = np.arange(12, dtype="float32").reshape(3, 4).T  # (4, 3), strided
    indices = [(slice(0, 2), slice(None)), (slice(2, 4), slice(1, 3))]
    outputs = [np.empty((2, 3), ml_dtypes.bfloat16), np.empty((2, 2), "float32")]
    executor = concurrent.futures.ThreadPoolExecutor(2)
    file_reads.copy_slices(source, indices, outputs, executor)
    assert outputs[0].astype("float32").tolist() == source[:2].tolist()
    assert outputs[1].tolist() == source[2:4, 1:3].tolist()


def test_reserved_shards_are_the_placeholders_buffers():
    """One aligned buffer per device, zeros, adopted by the placeholder and
    handed to the value's reads once, for the same shape, dtype and
    sharding."""
    mesh = mesh_of((2, 4)).backend_mesh
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "model")
    )
    reserved = transfer.ReservedShards()
    try:
        zeros = reserved.placeholder("a", (6, 8), "bfloat16", sharding)
        reserved.placeholder("b", (6, 8), "bfloat16", sharding).delete()
        adopted = [s.data.unsafe_buffer_pointer() for s in zeros.addressable_shards]
        assert not np.asarray(zeros).any()
        zeros.delete()
        assert reserved.take("c", (6, 8), "bfloat16", sharding) is None
        assert reserved.take("b", (6, 8), "float32", sharding) is None  # dropped
        assert reserved.take("b", (6, 8), "bfloat16", sharding) is None
        buffers = reserved.take("a", (6, 8), "bfloat16", sharding)
        assert reserved.take("a", (6, 8), "bfloat16", sharding) is None
    finally:
        reserved.close()
    assert len(buffers) == len(sharding.addressable_devices) == 8
    assert {b.shape for b in buffers} == {(6, 2)}
    assert {b.dtype for b in buffers} == {np.dtype(ml_dtypes.bfloat16)}
    assert [b.ctypes.data for b in buffers] == adopted
    assert all(start % file_reads.BUFFER_ALIGNMENT == 0 for start in adopted)
    assert len(set(adopted)) == 8
    assert all(not b.any() for b in buffers)


def test_a_cpu_load_reads_into_the_buffers_reserved_while_building(
    tmp_path, monkeypatch
):
    """Every weight's shards are its placeholder's buffers themselves,
    filled by the reads."""
    path = backbone_preset(tmp_path / "bf16", tiny_presets.GEMMA_MQA, dtype="bfloat16")
    single = keras_hub.models.Backbone.from_preset(path)
    taken = set()
    take = transfer.ReservedShards.take

    def recording_take(shards, *args):
        buffers = take(shards, *args)
        taken.update(b.ctypes.data for b in buffers or [] if b.size)
        return buffers

    monkeypatch.setattr(transfer.ReservedShards, "take", recording_take)
    backbone = keras_hub.models.Backbone.from_preset(
        path, device_mesh={"batch": 2, "model": 4}
    )
    for weight, expected in zip(backbone.weights, single.weights):
        np.testing.assert_array_equal(np.asarray(weight.value), expected.numpy())
        for shard in weight.value.addressable_shards:
            assert shard.data.unsafe_buffer_pointer() in taken, weight.path
