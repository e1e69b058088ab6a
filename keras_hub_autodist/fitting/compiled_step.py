"""The compiled memory check: XLA's own per-device bytes of a training step.

`compiled_memory(plan, batch_size, sequence_length)` builds the task model
(e.g. `GemmaCausalLM`) and its optimizer abstractly, with the plan's layout
map on a real `DeviceMesh`: every variable gets a shape, a dtype and the
sharding Keras would give it, but no value. It then compiles, ahead of
time, the very step `train_on_batch` runs (`model.train_step`: forward,
loss, gradients, the optimizer's `stateless_apply`, metrics), jitted as
Keras jits it (state donated, state shardings kept), against abstract
inputs of `(batch_size, sequence_length)` tokens, and returns XLA's
`memory_analysis()` for one device. No weight is allocated; compiling
needs the mesh's devices, not their memory. Where it and the closed form
disagree, trust this check. Compiled for a named accelerator, the model is
built and traced as on its devices (`compat.answering_for`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from keras_hub_autodist import compat
from keras_hub_autodist.errors import ModelClassError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.compile_arguments import built_optimizer
from keras_hub_autodist.fitting.compile_arguments import check_argument_kinds
from keras_hub_autodist.fitting.compile_arguments import check_model_class
from keras_hub_autodist.fitting.compile_arguments import default_task_class
from keras_hub_autodist.fitting.compile_targets import compile_mesh
from keras_hub_autodist.fitting.compiled_analysis import attention_kernel
from keras_hub_autodist.fitting.compiled_analysis import collectives
from keras_hub_autodist.fitting.compiled_analysis import leaked_trace_error
from keras_hub_autodist.fitting.compiled_analysis import not_compiled
from keras_hub_autodist.fitting.compiled_analysis import out_of_memory
from keras_hub_autodist.fitting.compiled_fit import compiled_fits
from keras_hub_autodist.fitting.hlo_cost import program_cost
from keras_hub_autodist.fitting.step_timing import timed_step_seconds
from keras_hub_autodist.planning.options import check_lora_rank
from keras_hub_autodist.planning.step_shape import runnable_step

if TYPE_CHECKING:
    import keras

    from keras_hub_autodist.planning.plan_record import PlanRecord

MIB = 1024**2


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled training step, per device.

    Args:
        argument_bytes: the step's inputs: weights, optimizer and metric
            state, and the device's slice of the batch.
        output_bytes: the step's outputs: the new state and the logs.
        alias_bytes: output bytes that reuse donated input buffers (the
            state is updated in place, as `train_on_batch` does).
        temp_bytes: the temporaries live at the step's peak: gradients,
            saved activations, gathered weights, workspace.
        generated_code_bytes: the compiled program itself (0 on CPU).
        peak_bytes: what a device holds at the step's peak, as the
            compiler counts it: on a TPU or a GPU the program's own
            `peak_memory_in_bytes` (`PROGRAM_PEAK_PLATFORMS`), what the TPU
            compiler holds a program to; else (and where none is reported)
            `argument_bytes + output_bytes - alias_bytes + temp_bytes`. For
            a step the compiler refused, the bytes its refusal names.
        batch_size: the global batch size asked for.
        sequence_length: tokens per sequence.
        optimizer: the optimizer's name.
        devices: the devices of the mesh.
        platform: the devices' platform (`"cpu"`, `"gpu"`, `"tpu"`).
        padded_batch_size: the global batch compiled for: `batch_size`
            padded to a multiple of the batch axis, as a bound `fit` pads
            it (`None`: not said, taken as `batch_size`).
        device_kind: what JAX calls one of them (`"TPU v5 lite"`).
        target: the named device compiled for (`"v5e"`), or `""` for this
            machine's devices.
        cost: XLA's cost analysis per device (`flops`, `bytes_accessed`,
            `optimal_seconds` where the backend gives one), and
            `measured_seconds` where the step was timed on this machine's
            devices (`compiled_memory(..., timed_steps=...)`).
        collectives: the step's collectives (`compiled_analysis.Collective`).
        attention: the attention the step runs, read from the program:
            `"splash"`, `"cudnn_flash"`, `"xla"` or another kernel's name.
        out_of_memory: the compiler's refusal when the step does not fit the
            device (the TPU compiler refuses at compile time), or the
            device's, when the step timed on it ran out of memory; then
            `peak_bytes` is its figure of the memory needed, and the other
            sizes those the step was given.
        compiler_limit_bytes: the memory per device the compiler holds a
            program to: the figure its refusal names, or, for a step
            compiled for a named TPU, that device's
            (`DeviceProfile.memory_bytes`); 0 where not known (a GPU's
            compiler holds a program to no limit when compiling it).
        device_memory_bytes: the memory per device the step is held to
            (the plan's `device_memory_bytes`), which `fits` reads; 0 where
            not known.

    Example:
    ```python
    memory = compiled_memory(plan, 8, 2048)
    print(memory)                  # one line per field, in MiB
    memory.peak_bytes <= plan.device_memory_bytes
    ```
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    batch_size: int
    sequence_length: int
    optimizer: str
    devices: int
    platform: str
    padded_batch_size: int | None = None
    device_kind: str = ""
    target: str = ""
    cost: dict = dataclasses.field(default_factory=dict)
    collectives: tuple = ()
    attention: str = ""
    out_of_memory: str = ""
    compiler_limit_bytes: int = 0
    # What the step is held to, not a fact of the program: two compiles of
    # one step are equal whatever memory each was held to.
    device_memory_bytes: int = dataclasses.field(default=0, compare=False)

    @property
    def parts_bytes(self) -> int:
        """Every buffer of the program summed: `argument_bytes +
        output_bytes - alias_bytes + temp_bytes` (the peak where the
        compiler reports none of its own)."""
        return (
            self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        )

    @property
    def fits(self) -> bool | None:
        """Whether the step fits `device_memory_bytes` per device, by the
        one rule of every compiled verdict (`compiled_fits`);
        `False` for a step the compiler refused, `None` where the memory
        it is held to is not known."""
        if self.out_of_memory:
            return False
        if not self.device_memory_bytes:
            return None
        return compiled_fits(self, self.device_memory_bytes)

    def compiled_for(self) -> dict:
        """`{"platform", "device_kind", "devices"}`: what was compiled for."""
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "devices": self.devices,
        }

    def summary(self) -> str:
        """The check as a few lines of text, in MiB per device."""

        def mib(n):
            return f"{n / MIB:,.1f} MiB"

        padded = self.padded_batch_size not in (None, self.batch_size)
        batch = f"{self.batch_size}" + (
            f" (padded to {self.padded_batch_size})" if padded else ""
        )
        named = self.device_kind and self.device_kind.lower() != self.platform
        kind = f" {self.device_kind}" if named else ""
        lines = [
            f"compiled training step (XLA, {self.platform}{kind}, "
            f"{self.devices} devices), batch {batch} x "
            f"{self.sequence_length} tokens, {self.optimizer}; per device:"
        ]
        if self.out_of_memory:
            return "\n".join(
                [
                    *lines,
                    f"  does not fit: the compiler needs {mib(self.peak_bytes)} "
                    f"of {mib(self.compiler_limit_bytes)} "
                    f"({self.out_of_memory.splitlines()[0][:200]})",
                ]
            )
        return "\n".join(
            [
                *lines[:1],
                f"  arguments (weights, optimizer state, batch): "
                f"{mib(self.argument_bytes)}",
                f"  outputs: {mib(self.output_bytes)}, of which "
                f"{mib(self.alias_bytes)} reuse donated arguments",
                f"  temporaries (gradients, activations): {mib(self.temp_bytes)}",
                f"  peak: {mib(self.peak_bytes)}",
            ]
            + ([f"  attention: {self.attention}"] if self.attention else [])
        )

    def __str__(self):
        return self.summary()


def _backbone_config(plan, preset):
    from keras_hub_autodist.planning.shapes import backbone_class_named
    from keras_hub_autodist.reading.dtypes import mixed_policy
    from keras_hub_autodist.reading.dtypes import variable_dtype
    from keras_hub_autodist.reading.presets import read_config

    source = plan.preset if preset is None else preset
    if preset is None and plan.preset.startswith("<"):
        raise PlanError(
            f"This plan was made from {plan.preset}, which can't be read "
            "again; pass what you planned as preset= (the config dict or "
            f"the model). Received: plan.preset={plan.preset!r}"
        )
    info = read_config(source)
    backbone_cls = info.backbone_cls or backbone_class_named(info.backbone_class)
    config = dict(info.config)
    # The policy the plan was made with (`dtype=`): a mixed one computes in
    # 16 bits on float32 variables, so the variables' dtype alone won't do.
    mixed = getattr(plan, "mixed_policy", "")
    if mixed:
        config["dtype"] = mixed
    elif variable_dtype(config) != plan.dtype or mixed_policy(config):
        config["dtype"] = plan.dtype
    return backbone_cls, config


def _abstract_model(plan, mesh, model_class, preset, optimizer, tokens, lora_rank):
    """The task model and its optimizer, built with deferred variables that
    carry their layouts, and the distribution they were laid out with."""
    from keras_hub_autodist.attention.context_attention import (
        install_per_device_attention,
    )
    from keras_hub_autodist.attention.xla_path import attention_through_xla
    from keras_hub_autodist.loss.chunked_steps import install_chunked_loss
    from keras_hub_autodist.planning.distribution import plan_distribution
    from keras_hub_autodist.planning.remat import remat_scope
    from keras_hub_autodist.planning.remat import rematerialize_blocks

    backbone_cls, config = _backbone_config(plan, preset)
    task_cls = model_class or default_task_class(backbone_cls)
    distribution = plan_distribution(plan, mesh)
    with distribution.scope():
        with compat.deferred_variables(), remat_scope(plan.remat):
            backbone = backbone_cls.from_config(config)
            if lora_rank is not None:
                # Frozen weights: only the LoRA kernels are trained.
                backbone.enable_lora(lora_rank)
        rematerialize_blocks(backbone, plan)
        attention_through_xla(backbone, plan)
        install_per_device_attention(backbone, plan)
    # A task compiles itself with a default optimizer on construction, and
    # `compile` builds the optimizer's scalar variables (its iteration
    # count, its learning rate): they take values, made outside the
    # distribution so that they live on this machine's default device,
    # never on a compiler's compile-only ones. The step is compiled against
    # abstract state with the distribution's layouts; where values live
    # plays no part in it.
    model = task_cls(backbone=backbone, preprocessor=None)
    model.compile(optimizer=optimizer)
    # The loss a bound model's step takes: a chunk of tokens at a time.
    install_chunked_loss(model, plan)
    with distribution.scope():
        for variable in model.variables:
            compat.set_variable_layout(
                variable, distribution.get_variable_layout(variable)
            )
        with compat.deferred_variables():
            try:
                x = dict.fromkeys(_input_names(model), tokens)
                compat.symbolic_build(model, (x, tokens))
            except RuntimeError as error:
                if plan.remat is None:
                    raise
                # Keras' remat traces every argument of a layer's call,
                # `training` included, which keras-hub's blocks test.
                raise PlanError(
                    "This model's training step can't be traced with "
                    f"rematerialization {plan.remat!r}: Keras' RematScope "
                    "recomputes whole layers whose call tests a Python "
                    "argument (keras-hub's decoder blocks). Use "
                    "`remat='full'` (each decoder block recomputed), or "
                    "`remat={'mode': 'list_of_layers', 'layer_names': [...]}` "
                    "naming leaf layers (e.g. the MLP's dense layers). "
                    f"Received: remat={plan.remat!r}"
                ) from error
    return model, distribution


def _state_shardings(model, distribution):
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    return tuple(
        [distribution.get_variable_layout(v).backend_layout for v in group]
        for group in groups
    ), groups


def _abstract(variable, sharding):
    import jax

    return jax.ShapeDtypeStruct(
        tuple(variable.shape), variable.dtype, sharding=sharding
    )


@compat.global_random_kept()  # the model it builds is this package's own
def compiled_memory(
    plan: PlanRecord,
    batch_size: int,
    sequence_length: int,
    optimizer: str = "adam",
    *,
    model_class: type | None = None,
    preset: str | os.PathLike | None = None,
    device_mesh: keras.distribution.DeviceMesh | None = None,
    lora_rank: int | None = None,
    device: str | None = None,
    gradient_accumulation_steps: int = 1,
    timed_steps: int = 0,
) -> CompiledMemory:
    """Compile a plan's training step ahead of time; XLA's bytes per device.

    Args:
        plan: a `LayoutPlan`.
        batch_size: the global batch size, split over the batch axis; one
            that the batch axis doesn't divide is padded up to a multiple
            of it, as a bound `fit` pads it.
        sequence_length: tokens per sequence; the context axis, if any,
            must divide it (`SequenceLengthError`, as `fit` raises).
        optimizer: `"adam"`, `"sgd"`, `"sgd_momentum"`, or a
            `keras.optimizers.Optimizer` (a copy is built; yours is left
            as it is).
        model_class: the keras-hub task class to train; defaults to the
            backbone's `CausalLM` (e.g. `GemmaCausalLM`).
        preset: what the plan was made from, when `plan.preset` can't be
            read again (a config dict or a model instance).
        device_mesh: the `keras.distribution.DeviceMesh` to compile for;
            defaults to one of the planned shape over the first devices.
            With `device=`, its shape and axis names over that device's
            devices (`compile_targets.compile_mesh`).
        lora_rank: compile a LoRA fine-tune of this rank (`enable_lora`):
            only the LoRA kernels are trained; defaults to the plan's.
        device: a named accelerator to compile for, on any machine
            (`"t4"`, `"v3-8"`, `"v5e"`, `"h100"`, ... of
            `compile_targets.TARGETS`), as many of them as the plan's mesh
            has; defaults to the device the plan was made for
            (`plan(..., device_memory="t4")`) when no `device_mesh` is
            given, else this machine's devices.
            Needs the target's compiler (`keras-hub-autodist[tpu-compile]`
            or `[gpu-compile]`) unless this machine has such devices.
        gradient_accumulation_steps: compile one micro-step of an optimizer
            that applies the gradients of this many steps at once (Keras'
            own accumulation: one accumulator per trained weight).
        timed_steps: where the devices compiled for are this machine's
            (not a compiler's stand-ins), also run the step this many
            times, after one untimed run, on zero-filled weights and
            tokens (`step_timing`), and keep the median seconds as
            `cost["measured_seconds"]`; a device that can't hold the step
            then is said in `out_of_memory`. 0: not run.

    Returns:
        A `CompiledMemory`.

    Example:
    ```python
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
    plan = keras_hub_autodist.plan("./gemma_2b", mesh, dtype="bfloat16")
    memory = compiled_memory(plan, 8, 2048, "adam")
    memory.peak_bytes, memory.temp_bytes
    ```
    """
    import jax
    import numpy as np

    check_argument_kinds(
        plan=plan,
        device=device,
        model_class=model_class,
        gradient_accumulation_steps=gradient_accumulation_steps,
        timed_steps=timed_steps,
    )
    check_model_class(model_class, plan)
    mesh, target = compile_mesh(plan, device_mesh, device)
    # The step a bound `fit` runs: the batch padded to the batch axis, a
    # sequence the context axis doesn't divide refused.
    runs = runnable_step(
        plan.mesh_axes, batch_size, sequence_length, "compiled memory check"
    )
    keras_optimizer, optimizer_name = built_optimizer(
        optimizer, gradient_accumulation_steps
    )
    tokens = jax.ShapeDtypeStruct((runs.rows, sequence_length), np.int32)
    if lora_rank is None:
        lora_rank = plan.lora_rank
    check_lora_rank(lora_rank)
    with compat.answering_for(target.platform, target.device_kind):
        model, distribution = _abstract_model(
            plan, mesh, model_class, preset, keras_optimizer, tokens, lora_rank
        )
        with distribution.scope():
            shardings, groups = _state_shardings(model, distribution)
            state = tuple(
                [_abstract(v, s) for v, s in zip(group, group_shardings)]
                for group, group_shardings in zip(groups, shardings)
            )
            data_sharding = distribution.get_data_layout(tokens.shape).backend_layout
            placed = jax.ShapeDtypeStruct(
                tokens.shape, tokens.dtype, sharding=data_sharding
            )
            x = {name: placed for name in _input_names(model)}
            step = jax.jit(
                model.train_step, donate_argnums=0, out_shardings=(None, shardings)
            )
            traced = step.trace(state, (x, placed, None))
            fields = {
                "batch_size": batch_size,
                "padded_batch_size": runs.rows,
                "sequence_length": sequence_length,
                "optimizer": optimizer_name,
                "devices": len(target.devices),
                "platform": target.platform,
                "device_kind": target.device_kind,
                "target": target.name,
                "device_memory_bytes": plan.device_memory_bytes,
            }
            leaked = compat.leaked_tracers(traced)
            if leaked:
                raise leaked_trace_error(leaked, plan.dtype, fields)
            try:
                compiled = traced.lower().compile()
            except Exception as error:
                refusal = out_of_memory(error)
                if refusal is None:
                    raise not_compiled(error, plan.dtype, fields) from error
                arguments = _argument_bytes((state, (x, placed, None)))
                return _refused(error, refusal, arguments, fields)
    memory = memory_of(
        compiled,
        **fields,
        **program_facts(compiled),
        compiler_limit_bytes=_program_limit(target),
    )
    if timed_steps and not target.compile_only:
        memory = _timed(memory, compiled, state, (x, placed, None), timed_steps)
    return memory


def _timed(memory, compiled, state, data, steps) -> CompiledMemory:
    """`memory` with the step's measured seconds on this machine's devices
    (`step_timing`) in its cost; with the device's refusal as
    `out_of_memory` where running it runs out of memory."""
    try:
        seconds = timed_step_seconds(compiled, state, data, steps)
    except Exception as error:
        if out_of_memory(error) is None:
            raise
        return dataclasses.replace(
            memory, out_of_memory=str(error).strip() or type(error).__name__
        )
    return dataclasses.replace(
        memory, cost={**memory.cost, "measured_seconds": seconds}
    )


def _program_limit(target) -> int:
    """The memory per device the compiler of a named TPU holds a program
    to (it refuses a larger one); 0 for any other target."""
    from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES

    profile = DEVICE_PROFILES.get(target.name)
    if profile is None or profile.platform != "tpu" or target.platform != "tpu":
        return 0
    return profile.memory_bytes


def _argument_bytes(tree) -> int:
    """Bytes one device holds of abstract arrays with shardings: its shard
    of each (the largest shard, where they differ)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def _refused(error, refusal, arguments, fields) -> CompiledMemory:
    """The answer of a step the compiler refused as too large: its own
    figures of what the step needs (arguments included: the TPU compiler's
    figure counts them) and what the device has; the arguments alone where
    the refusal's figures can't be read."""
    needed, limit = refusal
    peak = needed or arguments
    return CompiledMemory(
        argument_bytes=arguments,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=max(peak - arguments, 0),
        generated_code_bytes=0,
        peak_bytes=peak,
        **fields,
        out_of_memory=str(error).strip() or type(error).__name__,
        compiler_limit_bytes=limit,
    )


def program_facts(compiled) -> dict:
    """The cost, collectives and attention kernel of a compiled step, as
    `CompiledMemory` fields (`memory_of(compiled, **program_facts(compiled),
    ...)`)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # backends without a cost model
        cost = None
    try:
        text = compiled.as_text()
    except Exception:  # a program without text
        text = ""
    return {
        "cost": program_cost(cost, text),
        "collectives": collectives(text),
        "attention": attention_kernel(text),
    }


# The inputs the check feeds, `[rows, sequence]` int32 (Gemma 4's positions).
FED_INPUTS = ("token_ids", "padding_mask", "position_ids")


def _input_names(model) -> list[str]:
    inputs = model.input
    if not isinstance(inputs, dict):
        raise ModelClassError(
            "The compiled memory check feeds token inputs by name; this "
            f"model takes {type(inputs).__name__} inputs. Received: "
            f"model class {type(model).__name__}"
        )
    names = sorted(inputs)
    unknown = [n for n in names if n not in FED_INPUTS]
    if unknown:
        raise ModelClassError(
            f"The compiled memory check feeds {list(FED_INPUTS)} only; "
            f"{type(model).__name__} also takes {unknown}. Received: "
            f"inputs {names}"
        )
    return names


def memory_of(compiled, **fields) -> CompiledMemory:
    """A `CompiledMemory` from a compiled JAX function's `memory_analysis()`.

    Args:
        compiled: the result of `jax.jit(f).lower(...).compile()`.
        **fields: `batch_size`, `sequence_length`, `optimizer`, `devices`,
            `platform`, and `padded_batch_size` when the batch compiled
            differs from `batch_size`.

    Example:
    ```python
    memory_of(jax.jit(step).lower(state, batch).compile(), batch_size=8, ...)
    ```
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise PlanError(
            "This JAX backend reports no memory analysis for compiled "
            "programs; the compiled memory check needs one (CPU, GPU and TPU "
            f"do). Received: {compiled!r}"
        )

    def read(name):
        return int(getattr(analysis, name, 0) or 0)

    sizes = {field: read(name) for field, name in _ANALYSIS_FIELDS.items()}
    # Unless said, the batch compiled is the one asked for.
    fields.setdefault("padded_batch_size", fields.get("batch_size"))
    memory = CompiledMemory(**sizes, peak_bytes=0, **fields)
    own = read("peak_memory_in_bytes")
    reports_peak = fields.get("platform") in PROGRAM_PEAK_PLATFORMS
    peak = own if own and reports_peak else memory.parts_bytes
    return dataclasses.replace(memory, peak_bytes=peak)


# The platforms whose compiler reports a program's own peak
# (`peak_memory_in_bytes`), counting only the buffers live at once: what
# the TPU compiler holds a program to. The sum of the parts counts them
# all: on a TPU v5e, Qwen 2.5 0.5B's full fine-tune of 8 x 1024 tokens
# peaks at 15.08 GiB, its parts sum to 15.82 GiB, and the chip runs it in
# 15.75 GiB. XLA's CPU compiler's peak leaves its temporaries out (53,800
# bytes for a tiny Gemma's step whose temporaries alone take 198,704):
# there the sum of the parts is the peak.
PROGRAM_PEAK_PLATFORMS = ("tpu", "gpu")


# `CompiledMemory` field ← the attribute of XLA's memory analysis it copies.
_ANALYSIS_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}


__all__ = [
    "PROGRAM_PEAK_PLATFORMS",
    "CompiledMemory",
    "compiled_memory",
    "default_task_class",
    "memory_of",
    "program_facts",
]
