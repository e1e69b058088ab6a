"""What the layout search's tests share: the tiny configs they search (as
a `{"class_name", "config"}` preset, no weights), a compiled step as a
stand-in compiler answers it, and a stand-in compiler that refuses a step
over a number of sequences per device (`batch_limited_compiler`), and the
search of the tiny Gemma they drive (`search_tiny_gemma`)."""

import types

from keras_hub_autodist.fitting.compiled_analysis import Collective
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.searching import search as search_module

# A tiny Gemma with multi-query attention.
TINY_GEMMA = {
    "class_name": "GemmaBackbone",
    "config": dict(
        vocabulary_size=256,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
    ),
}
# A tiny Gemma whose every dimension fills the TPU's (8, 128) tiles: the
# TPU compiler pads smaller arrays to them, and the state it is given is
# then larger than the plan's.
TILED_GEMMA = {
    "class_name": "GemmaBackbone",
    "config": dict(
        vocabulary_size=512,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=256,
        intermediate_dim=512,
        head_dim=128,
    ),
}


def stand_in_memory(
    layout, batch_size, sequence_length, optimizer="adam", **_
) -> CompiledMemory:
    """A compiled step as a stand-in compiler answers it: a small peak, and
    a step time that grows with the model axis (so that layouts differ)."""
    axes = dict(zip(layout.mesh_axes.axis_names, layout.mesh_axes.shape))
    return CompiledMemory(
        argument_bytes=1024,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=1024,
        generated_code_bytes=0,
        peak_bytes=2048,
        batch_size=batch_size,
        sequence_length=sequence_length,
        optimizer=optimizer,
        devices=layout.mesh_axes.num_devices,
        platform="tpu",
        cost={"optimal_seconds": 0.01 * axes.get("model", 1)},
        collectives=(Collective("all-reduce", 1, 8),),
    )


GIB = 1024**3
REFUSAL = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"


def tpu_memory(batch_size, sequence_length, devices, **fields) -> CompiledMemory:
    """A step compiled for a TPU, 2 KiB at its peak unless `fields` say."""
    sizes = dict(argument_bytes=1024, temp_bytes=1024, peak_bytes=2048)
    return CompiledMemory(
        output_bytes=0,
        alias_bytes=0,
        generated_code_bytes=0,
        batch_size=batch_size,
        sequence_length=sequence_length,
        optimizer="adam",
        devices=devices,
        platform="tpu",
        **{**sizes, **fields},
    )


def batch_limited_compiler(monkeypatch):
    """Put a stand-in compiler for one kind of device in the search's place
    (`search.compiled_memory`), and return its state: a step fits up to
    `limits[remat]` sequences per device and is refused over it; its time
    per token falls with the batch (the weights read once per step) and is
    `remat_cost[remat]` times longer with remat, `accumulation_cost` times with
    accumulation (`per_token(rows)`: its seconds per token without either);
    its peak grows with the batch. `calls` lists `(per-device batch, remat,
    accumulation)` of each compile."""
    state = types.SimpleNamespace(
        calls=[],
        limits={None: 4, "dots": 8, "full": 16},
        remat_cost={"dots": 1.2, "full": 1.3},
        accumulation_cost=1.1,
        per_token=lambda rows: (1 + 8 / rows) * 1e-6,
    )

    def compiled_memory(layout, batch_size, sequence_length, optimizer, **kwargs):
        rows = batch_size // layout.mesh_axes.size(layout.mesh_axes.batch_axis)
        steps = kwargs["gradient_accumulation_steps"]
        state.calls.append((rows, layout.remat, steps))
        devices = layout.mesh_axes.num_devices
        if rows > state.limits[layout.remat]:
            return tpu_memory(
                batch_size,
                sequence_length,
                devices,
                peak_bytes=21 * GIB,
                out_of_memory=REFUSAL,
                compiler_limit_bytes=16 * GIB,
            )
        per_token = state.per_token(rows)
        per_token *= state.remat_cost[layout.remat] if layout.remat else 1.0
        per_token *= state.accumulation_cost if steps > 1 else 1.0
        seconds = per_token * batch_size * sequence_length
        return tpu_memory(
            batch_size,
            sequence_length,
            devices,
            peak_bytes=1024 * (rows + 1),
            cost={"optimal_seconds": seconds},
        )

    monkeypatch.setattr(search_module, "compiled_memory", compiled_memory)
    return state


def search_tiny_gemma(tmp_path, **kwargs):
    """`search()` of `TINY_GEMMA` on one v5e at 32 tokens (unless `kwargs`
    say), its compiles cached under `tmp_path`."""
    from keras_hub_autodist.searching.search import search

    arguments = dict(device="v5e", devices=1, sequence_length=32)
    arguments.update(kwargs)
    return search(TINY_GEMMA, cache_dir=tmp_path / "compiles", **arguments)
