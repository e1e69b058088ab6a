"""What the layout search's tests share: the tiny configs they search (as
a `{"class_name", "config"}` preset, no weights) and a compiled step as a
stand-in compiler answers it."""

from keras_hub_autodist.fitting.compiled_analysis import Collective
from keras_hub_autodist.fitting.compiled_step import CompiledMemory

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
