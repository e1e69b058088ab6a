"""`remat=` checked whole: each form `from_preset`, `plan()` and the CLI
take, as data (`REMAT_ARGUMENTS`), so that a wrong key or value is refused
at the door, before Keras' `RematScope` sees it."""

from __future__ import annotations

from keras_hub_autodist.errors import PlanError

# `keras.RematScope` modes `remat=` takes. With `"full"` every layer's
# call is recomputed in the backward pass: a block keeps only its input;
# the other modes recompute some layers, which the estimate does not count
# (it stays an upper bound for them).
REMAT_MODES = ("full", "larger_than", "list_of_layers")


# What each mode takes beside `mode`, in a `remat=` dict: argument -> (what
# it is, its check). `"full"` takes nothing else; `"list_of_layers"` needs
# its layer names (without them Keras recomputes no layer at all).
REMAT_ARGUMENTS = {
    "full": {},
    "larger_than": {
        "output_size_threshold": (
            "a positive number of elements",
            lambda value: (
                isinstance(value, int) and not isinstance(value, bool) and value > 0
            ),
        ),
    },
    "list_of_layers": {
        "layer_names": (
            "a non-empty list of layer names",
            lambda value: (
                isinstance(value, (list, tuple))
                and bool(value)
                and all(isinstance(name, str) and name for name in value)
            ),
        ),
    },
}
REQUIRED_REMAT_ARGUMENTS = {"list_of_layers": ("layer_names",)}
REMAT_FORMS = (
    "None, 'full', 'larger_than' (Keras' default threshold of 1024 "
    "elements), {'mode': 'full'}, {'mode': 'larger_than', "
    "'output_size_threshold': 2**20} or {'mode': 'list_of_layers', "
    "'layer_names': ['mlp']}"
)


def _remat_error(problem: str, remat) -> PlanError:
    return PlanError(
        f"{problem} `remat` is one of: {REMAT_FORMS}. Received: remat={remat!r}"
    )


def check_remat(remat):
    """`remat=` checked whole: `None`, a mode of `REMAT_MODES`, or a dict of
    `keras.RematScope`'s arguments whose every key and value is one its
    mode takes (`REMAT_ARGUMENTS`). Returned unchanged.

    Example:
    >>> check_remat("full")
    'full'
    """
    if remat is None:
        return remat
    if isinstance(remat, str):
        if remat not in REMAT_MODES:
            raise _remat_error(f"Unknown mode {remat!r}.", remat)
        if remat in REQUIRED_REMAT_ARGUMENTS:
            raise _remat_error(
                f"Mode {remat!r} needs its "
                f"{', '.join(REQUIRED_REMAT_ARGUMENTS[remat])} (in a dict).",
                remat,
            )
        return remat
    if not isinstance(remat, dict):
        raise _remat_error("`remat` is a mode name or a dict.", remat)
    mode = remat.get("mode")
    if not isinstance(mode, str) or mode not in REMAT_MODES:
        raise _remat_error(
            f"A `remat` dict names its mode, one of {list(REMAT_MODES)}.", remat
        )
    accepted = REMAT_ARGUMENTS[mode]
    unknown = sorted(map(str, set(remat) - {"mode"} - set(accepted)))
    if unknown:
        taken = ", ".join(f"'{name}'" for name in accepted) or "nothing else"
        raise _remat_error(
            f"Mode {mode!r} takes {taken}; not {', '.join(map(repr, unknown))}.",
            remat,
        )
    for name in REQUIRED_REMAT_ARGUMENTS.get(mode, ()):
        if name not in remat:
            raise _remat_error(f"Mode {mode!r} needs {name!r}.", remat)
    for name, (what, valid) in accepted.items():
        if name in remat and not valid(remat[name]):
            raise _remat_error(f"{name!r} is {what}; got {remat[name]!r}.", remat)
    return remat


def remat_mode(remat) -> str | None:
    """The `keras.RematScope` mode of a `remat=` value.

    Example:
    >>> remat_mode({"mode": "list_of_layers", "layer_names": ["mlp"]})
    'list_of_layers'
    """
    return check_remat(remat).get("mode") if isinstance(remat, dict) else remat
