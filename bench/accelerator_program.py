"""A training step's program memory, as XLA compiled it for the device.

A TPU's `memory_stats()` peak leaves out a program's temporaries (after a
Gemma 2B LoRA step of 4 x 1024 tokens it read the weights alone), so the
bench reads the memory of the step Keras' trainer jitted:

- for a step that ran, its compiled program's `memory_analysis()`:
  temporaries + arguments + outputs - aliased (`program_memory`);
- for a step the device refused, the bytes its `RESOURCE_EXHAUSTED` message
  names, its arguments among them (`refused_memory`).

`recording_steps()` wraps the `jit` that Keras' JAX trainer builds its
steps with, so that each call records the jitted function and the shapes
and shardings it was called with (before the state is donated); the
program is then lowered and compiled again from those, which a persistent
compilation cache (`JAX_COMPILATION_CACHE_DIR`) answers without compiling.

This reaches into Keras' private module `keras.src.backend.jax.trainer`
(its module-level `jit`, which `make_train_function` calls): the bench is
not the package, and keeps that here rather than in
`keras_hub_autodist.compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses

_TRAINER = "keras.src.backend.jax.trainer"


@dataclasses.dataclass
class Recorded:
    """The latest step called through Keras' `jit`.

    Attributes:
        jitted: the `jax.jit` function Keras built.
        arguments: its call's arguments as `jax.ShapeDtypeStruct`s (with
            their shardings), None where an argument was None.
    """

    jitted: object = None
    arguments: tuple = ()


def _abstract(leaf):
    import jax

    if isinstance(leaf, jax.Array):
        # As the call compiled it: a sharding only where the array is
        # committed to its devices (else none is in the program), and its
        # weak type; so that the persistent cache has the program.
        committed = getattr(leaf, "committed", getattr(leaf, "_committed", True))
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=leaf.sharding if committed else None,
            weak_type=leaf.weak_type,
        )
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


@contextlib.contextmanager
def recording_steps():
    """Within it, every step Keras' JAX trainer jits records its latest
    call in the `Recorded` this yields.

    Example:
    ```python
    with recording_steps() as recorded:
        model.train_on_batch(x, y)
    memory = program_memory(recorded)
    ```
    """
    import importlib

    import jax

    trainer = importlib.import_module(_TRAINER)
    real_jit = trainer.jit
    recorded = Recorded()

    def recording_jit(fun, **options):
        jitted = real_jit(fun, **options)

        def call(*args):
            # Read before the call: the call donates the state's buffers.
            recorded.jitted = jitted
            recorded.arguments = jax.tree.map(_abstract, args)
            return jitted(*args)

        return call

    trainer.jit = recording_jit
    try:
        yield recorded
    finally:
        trainer.jit = real_jit


def argument_bytes(recorded: Recorded) -> int:
    """Bytes of the recorded call's arguments on one device (its shard of
    each, where an argument is sharded)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(recorded.arguments):
        sharding = getattr(leaf, "sharding", None)
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def program_memory(recorded: Recorded) -> dict:
    """The recorded step's program memory on one device, from XLA's
    `memory_analysis()` of its compiled program.

    Returns:
        `{"program_bytes", "temp_bytes", "argument_bytes", "output_bytes",
        "alias_bytes", "compiler_peak_bytes", "attention"}`, where
        `program_bytes` is temporaries + arguments + outputs - aliased,
        `compiler_peak_bytes` the compiler's own peak of the buffers live at
        once (`peak_memory_in_bytes`; 0 where it gives none), what a target
        compile reports on a TPU, and `attention` the attention kernel read
        from the program (`"xla"` where none is fused).
    """
    from keras_hub_autodist.fitting.compiled_analysis import attention_kernel

    compiled = recorded.jitted.lower(*recorded.arguments).compile()
    analysis = compiled.memory_analysis()

    def read(name):
        return int(getattr(analysis, name, 0) or 0)

    sizes = dict(
        temp_bytes=read("temp_size_in_bytes"),
        argument_bytes=read("argument_size_in_bytes"),
        output_bytes=read("output_size_in_bytes"),
        alias_bytes=read("alias_size_in_bytes"),
    )
    peak = read("peak_memory_in_bytes")
    program = (
        sizes["temp_bytes"]
        + sizes["argument_bytes"]
        + sizes["output_bytes"]
        - sizes["alias_bytes"]
    )
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - a program without text: kernel unknown
        text = ""
    return dict(
        program_bytes=program,
        **sizes,
        compiler_peak_bytes=peak,
        attention=attention_kernel(text),
    )


def refused_memory(error: BaseException, recorded: Recorded) -> dict | None:
    """What a step the device refused as too large asked for: the bytes its
    `RESOURCE_EXHAUSTED` message names (its arguments included); None for
    any other error.

    Returns:
        `{"program_bytes", "argument_bytes", "limit_bytes"}` or None.
    """
    from keras_hub_autodist.fitting.compiled_analysis import out_of_memory

    refusal = out_of_memory(error)
    if refusal is None:
        return None
    needed, limit = refusal
    arguments = argument_bytes(recorded) if recorded.jitted is not None else 0
    # (0, 0): a refusal whose figures can't be read.
    program = needed or None
    return dict(program_bytes=program, argument_bytes=arguments, limit_bytes=limit)
