"""How an optimizer's variables are named from one process, one wrapper
and one learning rate to the next.

Keras names an optimizer's variables after the optimizer (`adam/iteration`)
and numbers auto-named optimizers per process (`adam_1`). A wrapped
optimizer (`LossScaleOptimizer`, which `compile` puts around the optimizer
under `mixed_float16`; any optimizer that keeps another) lists its own
variables and its inner optimizer's, both with an `iteration` and a
`learning_rate`. `optimizer_keys` gives each variable a key that is the
same for a model's live variables and a checkpoint's saved paths, and
unique inside a wrapper. A learning rate is a setting of the run, not its
state: a schedule has no variable, and `without_one_sided_rates` lets a
resume change it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from collections.abc import Mapping


def without_owner(path: str) -> str:
    """An optimizer variable's path without the optimizer's own name."""
    return path.split("/", 1)[-1]


# Keras' per-process number of an auto-named object (`adam_1`).
_PROCESS_NUMBER = re.compile(r"_\d+$")
# The learning rate's variable: a setting of the run (a schedule has none),
# not state a resume must match.
LEARNING_RATE = "learning_rate"


def optimizer_keys(paths: Iterable[str]) -> dict[str, str]:
    """Path -> key of each optimizer variable, the same for a model's live
    variables and a checkpoint's saved paths: the path less its owner's
    name when one optimizer owns them all; with several (a wrapped
    optimizer), the owner's name less Keras' per-process number, then the
    variable's name. Two owners of one such name keep their numbers.

    Example:
    >>> optimizer_keys(["adam_2/iteration"])
    {'adam_2/iteration': 'iteration'}
    >>> sorted(optimizer_keys(["loss_scale_optimizer_1/iteration",
    ...                        "adam_3/iteration"]).values())
    ['adam/iteration', 'loss_scale_optimizer/iteration']
    """
    paths = list(paths)
    owners = {path.split("/", 1)[0] for path in paths if "/" in path}
    if len(owners) <= 1:
        return {path: without_owner(path) for path in paths}
    names = {owner: _PROCESS_NUMBER.sub("", owner) for owner in owners}
    if len(set(names.values())) < len(owners):
        names = {owner: owner for owner in owners}
    keys = {}
    for path in paths:
        owner, _, rest = path.partition("/")
        keys[path] = f"{names[owner]}/{rest}" if rest else path
    return keys


def optimizer_chain(optimizer) -> list[tuple[str, object]]:
    """The optimizer and each optimizer it keeps inside (a
    `LossScaleOptimizer`'s `inner_optimizer`, and theirs), with the path
    Keras' weights files store it under (`""` for the optimizer itself).

    Example:
    ```python
    [path for path, _ in optimizer_chain(lm.optimizer)]  # ['', 'inner_optimizer']
    ```
    """
    from keras_hub_autodist.compat import state as compat_state

    chain, pending, seen = [], [("", optimizer)], set()
    while pending:
        path, current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        chain.append((path, current))
        for name, child in compat_state.optimizer_children(current):
            pending.append((f"{path}/{name}" if path else name, child))
    return chain


def without_one_sided_rates(saved: Mapping, current: Mapping) -> tuple[dict, dict]:
    """Both optimizer groups less a `learning_rate` variable only one side
    has: a learning-rate schedule has none, a constant rate has one, and a
    rate is a setting of the run, not state (a resume with another schedule
    keeps the model's own).

    Example:
    >>> without_one_sided_rates({"learning_rate": ((), "float32")}, {})
    ({}, {})
    """

    def one_sided(key, other):
        return key.rsplit("/", 1)[-1] == LEARNING_RATE and key not in other

    return (
        {k: v for k, v in saved.items() if not one_sided(k, current)},
        {k: v for k, v in current.items() if not one_sided(k, saved)},
    )
