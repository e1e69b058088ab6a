"""`remat=` checked whole: each form `from_preset`, `plan()` and the CLI
take, as data (`BLOCK_POLICIES`, `REMAT_ARGUMENTS`), so that a wrong key or
value is refused at the door, before Keras' `RematScope` sees it."""

from __future__ import annotations

import dataclasses

from keras_hub_autodist.errors import PlanError


@dataclasses.dataclass(frozen=True)
class BlockPolicy:
    """A rematerialization this package runs itself, decoder block by
    decoder block (`planning.remat`): what each block keeps for its
    backward pass, the rest recomputed there.

    Args:
        keeps: what each block keeps, in words.
        saveable: the name of the `jax.checkpoint_policies` entry that says
            what the block keeps beside its inputs; `None`: its inputs
            alone.
        recomputes_matmuls: whether the backward pass computes the block's
            weight matmuls again (`searching.step_cost` counts one more
            forward pass of them).
    """

    keeps: str
    saveable: str | None = None
    recomputes_matmuls: bool = True


# The block policies `remat=` takes, by name. The weight matmuls' outputs
# are those of `jax.checkpoint_policies`' dots without batch dimensions:
# the query, key, value and output projections, the MLP's up-projections
# (and its down projection where a norm reads it), and LoRA's merged
# kernels; attention's scores and weighted sums have the batch and heads
# as batch dimensions, and are recomputed.
#
# Keeping those outputs in the host's pinned memory instead
# (`offload_dot_with_no_batch_dims("device", "pinned_host")`) is not
# offered: it does not keep its promise. XLA's CPU backend drops the
# copies (its device computes in host memory). Compiled for a TPU v5e
# (JAX 0.10.2) it compiles, but on 24 blocks that save 12 GiB of outputs
# the compiler copies 7.5 GiB to the host and the device's temporaries
# stay those of "dots" (13.4 GiB against 12.5, 1.9 with "full"); on 40
# blocks it is refused for HBM where "dots" compiles. Nor is "full" with
# the blocks' inputs offloaded (`save_and_offload_only_these_names`): the
# TPU compiler offloads them from blocks run in a `lax.scan` (4 blocks of
# 16 MiB inputs: 97 MiB of device temporaries, 208 with "full"), but from
# a Python loop of blocks, as keras-hub's are, it keeps more on the device
# than no rematerialization (442 MiB, 322 without remat, 266 with "full");
# integration/test_remat_offload.py checks both with the compiler installed.
BLOCK_POLICIES = {
    "full": BlockPolicy(keeps="its inputs"),
    "dots": BlockPolicy(
        keeps="its inputs and its weight matmuls' outputs",
        saveable="dots_with_no_batch_dims_saveable",
        recomputes_matmuls=False,
    ),
}
# `keras.RematScope`'s modes `remat=` takes: they recompute some layers,
# which the estimate does not count (it stays an upper bound for them).
KERAS_MODES = ("larger_than", "list_of_layers")
REMAT_MODES = (*BLOCK_POLICIES, *KERAS_MODES)


# What each mode takes beside `mode`, in a `remat=` dict: argument -> (what
# it is, its check). The block policies take nothing else;
# `"list_of_layers"` needs its layer names (without them Keras recomputes
# no layer at all).
REMAT_ARGUMENTS = {
    **dict.fromkeys(BLOCK_POLICIES, {}),
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
    "None, "
    + ", ".join(
        f"{name!r} (each decoder block keeps {policy.keeps})"
        for name, policy in BLOCK_POLICIES.items()
    )
    + ", 'larger_than' (Keras' default threshold of 1024 "
    "elements), {'mode': 'full'}, {'mode': 'larger_than', "
    "'output_size_threshold': 2**20} or {'mode': 'list_of_layers', "
    "'layer_names': ['mlp']}"
)


def _remat_error(problem: str, remat) -> PlanError:
    return PlanError(
        f"{problem} `remat` is one of: {REMAT_FORMS}. Received: remat={remat!r}"
    )


def check_remat(remat):
    """`remat=` checked whole: `None`, a mode of `REMAT_MODES` (a block
    policy of `BLOCK_POLICIES` or a `keras.RematScope` mode), or a dict of
    its arguments whose every key and value is one its mode takes
    (`REMAT_ARGUMENTS`). Returned unchanged.

    Example:
    >>> check_remat("full")
    'full'
    """
    if remat is None:
        return remat
    if remat == "auto":
        raise _remat_error(
            "'auto' is the layout search's to choose: only "
            "from_preset(..., device_mesh='auto') takes it.",
            remat,
        )
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
    """The mode of a `remat=` value: a block policy's name or a
    `keras.RematScope` mode.

    Example:
    >>> remat_mode({"mode": "list_of_layers", "layer_names": ["mlp"]})
    'list_of_layers'
    """
    return check_remat(remat).get("mode") if isinstance(remat, dict) else remat


def block_policy(remat) -> BlockPolicy | None:
    """The `BlockPolicy` of a `remat=` value, `None` for none or a Keras
    mode.

    Example:
    >>> block_policy("dots").recomputes_matmuls
    False
    """
    return BLOCK_POLICIES.get(remat_mode(remat))
