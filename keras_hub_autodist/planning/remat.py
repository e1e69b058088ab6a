"""Rematerialization of a model's training step (`remat=`).

The block policies (`remat_arguments.BLOCK_POLICIES`) recompute each
decoder block in the backward pass. With `remat="full"` the block keeps
only its inputs, and its activations are computed again from them when the
gradients need them, after the block output's cotangent
(`recomputed_in_backward`), so that every backend, XLA's CPU one included,
keeps one block's activations at a time. With `"dots"` it also keeps its
weight matmuls' outputs (a `jax.checkpoint` policy says which), and the
backward pass recomputes the rest from them, after the cotangent too.
Each block's `call` runs so, with its array arguments traced and every
other argument (keras-hub's `training` flag, cache indices, `None`) held
as it is: Keras' own `RematScope` traces every argument of a
rematerialized call, and keras-hub's blocks test some of them in Python,
so a step built under it does not trace. The blocks are found from the
plan: the layer that holds each query kernel.

A block's non-weight state (its dropout layers' seed generators) is threaded
through the recomputed call as explicit inputs and outputs: the state the
block advances comes out of it as a value, assigned after it, and the
backward pass recomputes with the same seeds the forward pass drew.

The other modes (`"larger_than"`, `"list_of_layers"`) are Keras'
`keras.RematScope`, for layers whose arguments are all arrays.
"""

from __future__ import annotations

import contextlib
import functools

from keras_hub_autodist import compat
from keras_hub_autodist.compat import state as compat_state
from keras_hub_autodist.planning.remat_arguments import BLOCK_POLICIES
from keras_hub_autodist.planning.remat_arguments import block_policy
from keras_hub_autodist.planning.remat_arguments import remat_mode


def remat_scope(remat):
    """`keras.RematScope` of a `remat=` value of a Keras-only mode; a no-op
    scope for `None` and for a block policy (see `rematerialize_blocks`).

    Example:
    ```python
    with remat_scope({"mode": "list_of_layers", "layer_names": ["mlp"]}):
        model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
    ```
    """
    import keras

    if remat is None or remat_mode(remat) in BLOCK_POLICIES:
        return contextlib.nullcontext()
    arguments = dict(remat) if isinstance(remat, dict) else {"mode": remat}
    return keras.RematScope(**arguments)


def block_paths(plan) -> list[str]:
    """The layer paths of the decoder blocks: the first path component of
    each query kernel, in model order.

    Example:
    ```python
    block_paths(plan)  # ['decoder_block_0', 'decoder_block_1', ...]
    ```
    """
    paths = []
    for row in plan.rows:
        if "heads" in row.logical_axes and row.path.endswith("/kernel"):
            block = row.path.split("/", 1)[0]
            if "/" in row.path and block not in paths:
                paths.append(block)
    return paths


def non_weight_state(layer) -> list:
    """The variables of `layer` (and its sublayers) that are not weights:
    Keras' class of state such as seed generators' RNG state.

    Example:
    >>> import keras
    >>> [v.name for v in non_weight_state(keras.layers.Dropout(0.1))]
    ['seed_generator_state']
    """
    weight_ids = {id(weight) for weight in layer.weights}
    return [v for v in layer.variables if id(v) not in weight_ids]


def checkpointed(call, state=(), policy=None):
    """`call` recomputed in the backward pass (`recomputed_in_backward`,
    keeping what the `jax.checkpoint` `policy` saves beside the inputs):
    its array arguments traced, the others (flags, indices, `None`) held as
    given, and the variables of `state` (the block's non-weight state, e.g.
    its seed generators') passed in and out as values."""
    import jax

    state = list(state)

    @functools.wraps(call)
    def run(*args, **kwargs):
        leaves, structure = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
        with compat_state.stateless_state(state) as values:

            def pure(*arrays):
                merged = list(leaves)
                for index, array in zip(traced, arrays[: len(traced)]):
                    merged[index] = array
                for variable, value in zip(state, arrays[len(traced) :]):
                    variable.assign(value)
                inner_args, inner_kwargs = jax.tree_util.tree_unflatten(
                    structure, merged
                )
                outputs = call(*inner_args, **inner_kwargs)
                return outputs, [variable.value for variable in state]

            outputs, advanced = recomputed_in_backward(
                pure, *(leaves[i] for i in traced), *values, policy=policy
            )
            for variable, value in zip(state, advanced):
                variable.assign(value)
        return outputs

    return run


def recomputed_in_backward(function, *arrays, policy=None):
    """`function(*arrays)`, keeping only its inputs for the backward pass,
    which recomputes the rest once the output's cotangent has arrived; with
    a `jax.checkpoint` `policy`, keeping also what the policy saves, the
    rest recomputed from it so.

    `jax.checkpoint` keeps XLA from merging the recomputation into the
    forward pass with an optimization barrier, which XLA's CPU backend
    drops before scheduling: the recomputation is merged back and the step
    keeps every activation. Here the recomputation reads its floating inputs
    (and what the policy saved) through `after_cotangent`, a data dependency
    no compiler pass removes, so it runs after the cotangent on every
    backend. Closed-over values (the block's weights, read from Keras'
    stateless scope) become explicit inputs through `jax.closure_convert`.
    """
    import jax

    converted, constants = jax.closure_convert(function, *arrays)

    def forward_only(inputs):
        return converted(*inputs)

    @jax.custom_vjp
    def run(inputs):
        return forward_only(inputs)

    def forward(inputs):
        # The outputs pass a barrier: without one the TPU compiler fuses the
        # residual stream's elementwise sums through every block into the
        # consumer after the last (the head, and in the backward pass the
        # first block's recomputation), so each block's float32 pieces stay
        # live until then. Gemma 3 1B, LoRA, 32k tokens, compiled for a
        # v5p: 15.02 GiB without the barrier, 5.98 GiB with it.
        return jax.lax.optimization_barrier(forward_only(inputs)), inputs

    def backward(inputs, cotangent):
        cotangents = floating_leaves(cotangent)
        ordered = tuple(after_cotangent(value, cotangents) for value in inputs)
        _, pullback = jax.vjp(forward_only, ordered)
        return pullback(cotangent)

    def forward_saving(inputs):
        # What the policy saves and the inputs are the pullback's leaves:
        # the residuals, the rest recomputed from them when it is called.
        outputs, pullback = jax.vjp(jax.checkpoint(forward_only, policy=policy), inputs)
        return jax.lax.optimization_barrier(outputs), pullback

    def backward_saving(pullback, cotangent):
        leaves, structure = jax.tree_util.tree_flatten(pullback)
        cotangents = floating_leaves(cotangent)
        ordered = [after_cotangent(leaf, cotangents) for leaf in leaves]
        return jax.tree_util.tree_unflatten(structure, ordered)(cotangent)

    if policy is None:
        run.defvjp(forward, backward)
    else:
        run.defvjp(forward_saving, backward_saving)
    return run((*arrays, *constants))


def floating_leaves(tree) -> list:
    """The non-empty floating arrays of `tree` (a cotangent)."""
    import jax
    import jax.numpy as jnp

    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size
    ]


def after_cotangent(value, cotangents):
    """`value` made to depend on `cotangents` (non-empty floating arrays),
    unchanged: plus zero times the cotangent of its shape (elementwise, so
    no device waits on another), or times one element of the first. `x + 0 *
    c` is `x` for every finite `c`; a non-finite cotangent makes the
    gradients non-finite either way. Integer and boolean values, and every
    value when there is no cotangent, are returned as they are."""
    import jax
    import jax.numpy as jnp

    if not cotangents or not jnp.issubdtype(value.dtype, jnp.floating):
        return value
    anchor = next((c for c in cotangents if c.shape == value.shape), None)
    if anchor is None:
        anchor = cotangents[0].reshape(-1)[0]
    anchor = jax.lax.stop_gradient(anchor).astype(value.dtype)
    return value + jnp.zeros((), value.dtype) * anchor


def rematerialize_blocks(model, plan) -> int:
    """With a block policy as `plan.remat` (`BLOCK_POLICIES`), make each
    decoder block of `model` recompute its activations in the backward
    pass, keeping what the policy saves; return how many blocks changed (0
    for a Keras mode or none).

    Args:
        model: a keras-hub Backbone or Task, built.
        plan: its `LayoutPlan`.
    """
    policy = block_policy(plan.remat)
    if policy is None:
        return 0
    saving = jax_policy(policy)
    wanted = set(block_paths(plan))
    changed = 0
    for layer in compat.sublayers(model):
        if layer.path in wanted and "call" not in vars(layer):
            compat.patch_instance(
                "rematerialized_blocks",
                layer,
                "call",
                checkpointed(layer.call, non_weight_state(layer), saving),
            )
            changed += 1
    return changed


def jax_policy(policy):
    """The `jax.checkpoint_policies` entry a `BlockPolicy` names, made with
    its arguments; `None` for a policy that keeps the inputs alone."""
    if policy.saveable is None:
        return None
    import jax

    return getattr(jax.checkpoint_policies, policy.saveable)
