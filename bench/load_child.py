"""One load of `bench/loading.py`, in its own process.

Usage: python -m bench.load_child PRESET VARIANT [--timed]

VARIANT is one of `bench.loading`'s; `dtype=bfloat16` at its end loads the
model in bfloat16, else the default (float32).

Prints one JSON line: load seconds, peak and final bytes per device (each
buffer counted once), the largest single shard, peak and baseline host RSS,
bytes read and the weight file's size, and the loader's own read and
transfer seconds.

Sampling the devices' bytes walks every live array at each weight the
loader places, and every 20 ms: on a ~1B model that adds about half a
second to a load. With `--timed` nothing is sampled (the memory fields are
absent), so the load time is the loader's alone; the bench times loads in
such runs and takes their memory from a sampled one.

Peak host RSS is this process's own: `getrusage(...).ru_maxrss` is not, as
Linux carries the high-water mark of the forking process (the bench, which
holds the presets it built) across `fork` + `exec`. The peak is
`VmHWM` from `/proc/self/status`, reset after the baseline is taken
(`/proc/self/clear_refs`), and at least the RSS sampled every 20 ms.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import keras_hub  # noqa: E402

import keras_hub_autodist  # noqa: E402
from bench.file_reads import FILE_READS  # noqa: E402
from bench.file_reads import read_file_only  # noqa: E402
from bench.file_reads import weight_files  # noqa: E402
from keras_hub_autodist import devices  # noqa: E402
from keras_hub_autodist.loading import session  # noqa: E402
from keras_hub_autodist.loading import transfer  # noqa: E402


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(field: str) -> int:
    """A `kB` field of `/proc/self/status` (e.g. `VmHWM`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Restart `VmHWM` from the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class Sampler:
    """Per-device bytes sampled every 20 ms, and at each loader allocation."""

    def __init__(self):
        self.peak = {}
        self.peak_rss = 0
        self.stop = False
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def record(self):
        self.peak_rss = max(self.peak_rss, rss_now())
        for device, size in devices.per_device_bytes().items():
            self.peak[str(device)] = max(self.peak.get(str(device), 0), size)

    def loop(self):
        while not self.stop:
            self.record()
            time.sleep(0.02)

    def hook_loader(self):
        put, placeholder = session._Session.put, transfer.placeholder

        def recording_put(session, *args, **kwargs):
            result = put(session, *args, **kwargs)
            self.record()
            return result

        def recording_placeholder(*args, **kwargs):
            result = placeholder(*args, **kwargs)
            self.record()
            return result

        session._Session.put = recording_put
        transfer.placeholder = recording_placeholder


def main(path, variant, mode=None):
    if mode not in (None, "--timed"):
        raise SystemExit(f"usage: {__doc__.splitlines()[2]}. Received: {mode!r}")
    timed = mode == "--timed"
    files = weight_files(path)
    file_bytes = sum(os.path.getsize(f) for f in files)
    if variant in FILE_READS:
        start = time.perf_counter()
        read = read_file_only(path, **FILE_READS[variant])
        seconds = time.perf_counter() - start
        print(
            json.dumps(
                dict(
                    variant=variant,
                    load_s=seconds,
                    bytes_read=read,
                    file_bytes=file_bytes,
                )
            )
        )
        return
    all_devices = keras.distribution.list_devices()
    baseline_rss = rss_now()
    hwm_reset = reset_peak_rss()
    sampler = Sampler()
    if not timed:
        sampler.hook_loader()
        sampler.thread.start()
    start = time.perf_counter()
    largest_shard = None
    if variant == "keras-hub one device":
        backbone = keras_hub.models.Backbone.from_preset(path)
    elif variant.startswith("keras-hub hand-made scope"):
        mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), all_devices)
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
        with distribution.scope():
            backbone = keras_hub.models.Backbone.from_preset(path)
    else:
        shape = (1, 8) if "(1,8)" in variant else (2, 4)
        strategy = "fsdp" if " fsdp" in variant else "tp"
        dtype = {"dtype": "bfloat16"} if variant.endswith("dtype=bfloat16") else {}
        mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), all_devices)
        backbone = keras_hub.models.Backbone.from_preset(
            path, device_mesh=mesh, strategy=strategy, **dtype
        )
    seconds = time.perf_counter() - start
    stats = keras_hub_autodist.load_stats(backbone)
    timings = dict(
        variant=variant,
        load_s=seconds,
        read_s=stats.read_seconds if stats else None,
        transfer_s=stats.transfer_seconds if stats else None,
        loading_s=stats.seconds if stats else None,
    )
    if timed:
        print(json.dumps(timings))
        return
    sampler.stop = True
    sampler.thread.join()
    sampler.record()
    final = {str(d): b for d, b in devices.per_device_bytes().items()}
    shards = []
    for weight in backbone.weights:
        for shard in weight.value.addressable_shards:
            shards.append(shard.data.nbytes)
    largest_shard = max(shards)
    largest_weight = max(w.value.nbytes for w in backbone.weights)
    peak_rss = sampler.peak_rss
    if hwm_reset:
        peak_rss = max(peak_rss, status_bytes("VmHWM"))
    over = {d: sampler.peak[d] - final.get(d, 0) for d in sampler.peak}
    worst = max(over, key=over.get)
    print(
        json.dumps(
            dict(
                **timings,
                params=backbone.count_params(),
                peak_device=sampler.peak[worst],
                final_device=final.get(worst, 0),
                worst_device=worst,
                largest_shard=largest_shard,
                largest_weight=largest_weight,
                final_local=sum(final.values()),
                baseline_rss=baseline_rss,
                peak_rss=peak_rss,
                peak_rss_sampled=sampler.peak_rss,
                bytes_read=(stats.bytes_read + stats.bytes_received) if stats else None,
                file_bytes=file_bytes,
            )
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
