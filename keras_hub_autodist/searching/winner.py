"""What the user writes to train with the layout search's winner: the
`from_preset` call with its mesh, strategy and remat, the optimizer with
its gradient accumulation, and `fit`'s batch, as code (`run_code`) and as
values (`run_values`). A result is a `search.SearchResult` (typed `Any`:
the search imports this module, not the other way round).

Imports neither Keras nor JAX.
"""

from __future__ import annotations

import json
from typing import Any

from keras_hub_autodist.fitting.trained_state import OPTIMIZERS


def run_values(result: Any) -> dict | None:
    """The winner's settings: `device_mesh`, `strategy`, `remat`,
    `per_device_batch`, `batch_size` (what `fit` is given: one step's
    sequences over all devices), `gradient_accumulation_steps` and
    `sequences_per_update`; `None` when nothing compiled fits."""
    chosen = result.chosen
    if not chosen.fits:
        return None
    candidate = chosen.candidate
    return {
        "device_mesh": dict(candidate.mesh),
        **candidate.settings(),
        "sequences_per_update": candidate.batch_size * candidate.accumulation,
    }


def _optimizer_code(name: str, steps: int) -> str:
    """The Keras optimizer a name of `OPTIMIZERS` builds, accumulating the
    gradients of `steps` steps where more than 1.

    Example:
    >>> _optimizer_code("sgd_momentum", 4)
    'keras.optimizers.SGD(momentum=0.9, gradient_accumulation_steps=4)'
    >>> _optimizer_code("adam", 1)
    'keras.optimizers.Adam()'
    """
    spec = OPTIMIZERS[name]
    arguments = [f"{key}={_literal(value)}" for key, value in spec.keras_kwargs]
    if steps > 1:
        arguments.append(f"gradient_accumulation_steps={steps}")
    return f"keras.optimizers.{spec.keras_class}({', '.join(arguments)})"


def _literal(value) -> str:
    """`value` (a string, a number, `None`, or a dict or list of them) as
    Python source, its strings in double quotes.

    Example:
    >>> _literal("full"), _literal(None), _literal({"mode": "full"})
    ('"full"', 'None', '{"mode": "full"}')
    """
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        items = ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items())
        return f"{{{items}}}"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_literal(v) for v in value)}]"
    return repr(value)


def run_code(result: Any) -> str:
    """The Python that loads and trains the winner, or `""` when nothing
    compiled fits.

    Example:
    ```python
    print(keras_hub_autodist.search(...).run_code)
    # lm = keras_hub.models.GemmaCausalLM.from_preset(
    #     "./gemma_2b",
    #     device_mesh={"batch": 1, "model": 1},
    #     strategy="tp",
    #     remat="full",
    # )
    # lm.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=4))
    # lm.fit(data, batch_size=8)  # 8 sequences of 2048 tokens per step ...
    ```
    """
    values = run_values(result)
    if values is None:
        return ""
    preset = result.preset if not result.preset.startswith("<") else "<your preset>"
    arguments = [
        _literal(preset),
        f"device_mesh={_literal(values['device_mesh'])}",
        f"strategy={_literal(values['strategy'])}",
        f"remat={_literal(values['remat'])}",
    ]
    if result.asked_dtype:
        arguments.append(f"dtype={_literal(result.asked_dtype)}")
    lines = [f"lm = keras_hub.models.{result.model_class}.from_preset("]
    lines += [f"    {argument}," for argument in arguments]
    lines.append(")")
    if result.lora_rank:
        lines.append(f"lm.backbone.enable_lora({result.lora_rank})")
    steps = values["gradient_accumulation_steps"]
    optimizer = _optimizer_code(result.optimizer, steps)
    lines.append(f"lm.compile(optimizer={optimizer})")
    batch, rows = values["batch_size"], values["per_device_batch"]
    per_update = (
        f"; {values['sequences_per_update']} per optimizer update" if steps > 1 else ""
    )
    lines.append(
        f"lm.fit(data, batch_size={batch})  # {batch} sequences of "
        f"{result.sequence_length} tokens per step, {rows} per device{per_update}"
    )
    return "\n".join(lines)


__all__ = ["run_code", "run_values"]
