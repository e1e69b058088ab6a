"""What a searched training step is compiled from, in one place.

The compile cache (`cache`) may serve a stored compile only for the same
program, so its key is a digest of everything the program is made from:
every field of `CompiledStepInputs` (what `search` hands
`compiled_step.compiled_memory`), each read in full, so that a field added
here is in the key without more code. Beside them, `cache.compile_key` adds
the versions of every compiler and library on the way and a digest of this
package's code.

- `plan`: the whole layout plan: the mesh and its axis roles, the strategy,
  every weight's sharding, the dtype and the mixed-precision policy, remat,
  the LoRA rank, the context- and sequence-parallel options, the logits'
  soft cap, the device's memory; all but its words of explanation
  (`DESCRIPTIVE_PLAN_FIELDS`) and the preset's name (`config` holds what
  was read from it);
- `config`: the backbone's config;
- the step: `batch_size`, `sequence_length`, `optimizer`, `lora_rank`,
  `gradient_accumulation_steps` (the optimizer then keeps an accumulator
  per trained weight and applies its update every so many steps);
- `device`: the named target;
- `timed_steps`: how many runs of the step are timed where the target is
  this machine's devices (an entry with a measured time is another entry);
- `environment` (`step_environment`): what building the step reads beside
  its arguments: Keras' global dtype policy and floatx (a config without a
  dtype is built in them), the flags and settings of XLA, libtpu and JAX
  that change a compiled program, the target's spec, and the rules the step
  is laid out by as data (the attention kernel each device runs,
  `attention.attention_blocks`; the chunks of the loss, `loss.chunks`), read
  as they are in this process.

`preset` rides along to build the step (it is read again for the model) and
stands in the key through `config`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from keras_hub_autodist.attention import attention_blocks
from keras_hub_autodist.loss import chunks
from keras_hub_autodist.planning.plan_record import PlanRecord
from keras_hub_autodist.reading.dtypes import floatx
from keras_hub_autodist.reading.dtypes import global_policy_name

# Fields of a plan that explain it in words and change nothing compiled.
DESCRIPTIVE_PLAN_FIELDS = (
    "preset",
    "strategy_reason",
    "mesh_reason",
    "device_memory_source",
)
# Environment variables read by the compilers a step goes through.
COMPILER_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# JAX settings that change a traced or compiled program.
JAX_SETTINGS = ("jax_default_matmul_precision", "jax_enable_x64")
# Modules holding, as data, rules that choose what the step runs.
RULE_MODULES = (attention_blocks, chunks)


def step_environment(device: str) -> dict:
    """What building a step for `device` reads beside its arguments
    (module docstring), as plain values.

    Example:
    >>> sorted(step_environment("v5e"))[:2]
    ['compiler_flags', 'dtype_policy']
    """
    jax = sys.modules.get("jax")
    settings = {
        name: repr(getattr(jax.config, name, None)) if jax is not None else ""
        for name in JAX_SETTINGS
    }
    return {
        "dtype_policy": global_policy_name(),
        "floatx": floatx(),
        "compiler_flags": {name: os.environ.get(name, "") for name in COMPILER_FLAGS},
        "jax_settings": settings,
        "target": _target(device),
        "rules": {module.__name__: _rule_data(module) for module in RULE_MODULES},
    }


def _target(device: str):
    """The compiler target of a named device; the name where none is
    known (the search refuses it before compiling)."""
    from keras_hub_autodist.errors import PlanError
    from keras_hub_autodist.fitting.compile_targets import target_spec

    try:
        return plain(target_spec(device))
    except PlanError:
        return plain(device)


def _rule_data(module) -> dict:
    """A module's constants (its upper-case names), as plain values."""
    return {
        name: plain(value)
        for name, value in sorted(vars(module).items())
        if name.isupper() and not name.startswith("_")
    }


@dataclasses.dataclass(frozen=True)
class CompiledStepInputs:
    """Everything a searched step is compiled from (module docstring).

    Example:
    ```python
    inputs = CompiledStepInputs(plan, config, 8, 2048, "adam", "v5e")
    cache.step_key(inputs)
    ```
    """

    plan: PlanRecord
    config: Mapping
    batch_size: int
    sequence_length: int
    optimizer: str
    device: str
    lora_rank: int | None = None
    preset: Any = dataclasses.field(default=None, compare=False)
    gradient_accumulation_steps: int = 1
    timed_steps: int = 0
    environment: Mapping = dataclasses.field(default=None)

    def __post_init__(self):
        if self.environment is None:
            object.__setattr__(self, "environment", step_environment(self.device))

    def key_fields(self) -> dict:
        """Every field but `preset`, the plan's without its descriptive
        ones, as plain JSON values."""
        fields = {
            field.name: plain(getattr(self, field.name))
            for field in dataclasses.fields(self)
            if field.name not in ("preset", "plan")
        }
        fields["plan"] = {
            field.name: plain(getattr(self.plan, field.name))
            for field in dataclasses.fields(self.plan)
            if field.name not in DESCRIPTIVE_PLAN_FIELDS
        }
        return fields

    def compile_arguments(self) -> tuple[tuple, dict]:
        """`(args, kwargs)` of `compiled_memory` for this step."""
        return (self.plan, self.batch_size, self.sequence_length, self.optimizer), {
            "device": self.device,
            "lora_rank": self.lora_rank,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "preset": self.preset,
            "timed_steps": self.timed_steps,
        }


def plain(value):
    """`value` as plain JSON values, every field of a dataclass and every
    item of a mapping or sequence included; anything else as its `repr`.

    Example:
    >>> plain({"axes": ("batch", None), 1: 2.5})
    {'axes': ['batch', None], '1': 2.5}
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: plain(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(item) for item in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return repr(value)
