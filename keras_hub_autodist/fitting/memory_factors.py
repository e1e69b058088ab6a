"""The calibrated factors of the closed-form step estimate, per platform.

Data only: how many buffers of each term of `step_memory.activation_terms`
XLA keeps at a training step's peak on each platform, what the optimizer's
update keeps beside the state, and where each factor was measured.
`step_memory` counts the terms and weighs them with these.
"""

# Buffers of each term live at the step's peak, per platform, in the
# model's dtype. Measured with `python -m bench.estimate_calibration`:
# - "cpu": against XLA's memory analysis of the compiled step on 8 virtual
#   CPU devices, Adam: 61 steps of real configs (llama3.2_1b, gemma3_1b,
#   gemma2_2b, gemma_2b, qwen2.5_0.5b; meshes 2x4, 4x2, 1x8, 8x1; tp and
#   fsdp; LoRA and full; 512 to 4096 tokens) land at 0.78-1.19x, 55 of
#   them within 15%, and 6 with and without `remat="full"` at 0.94-1.10x;
#   the bench models and the tests' tiny presets at 0.82-1.38x
#   (docs/benchmarks.md). XLA's CPU backend keeps about one and
#   a half buffers of each block's attention scores and a float32 mask per
#   block, two more score buffers for the block being differentiated, three
#   of the logits (four where the vocabulary is whole on each device: the
#   bench models at 8x1 and the tests' Gemma at 1x1 ask for the fourth, at
#   2x4 and 4x2 they land 1.2-1.4x over with it), and computes bfloat16
#   in float32 (`FLOAT32_ACTIVATIONS`).
#   Under `fsdp` it keeps two copies of the weights gathered over the batch
#   axis (the forward pass's, and the backward pass's own gathering), but
#   about one device share of them when the model axis has one device
#   (where two copies said 2.1-3.9x at 8x1).
#   Weights in bfloat16 are converted to float32 copies once and kept from
#   the forward pass to the backward pass (the matmul kernels and the
#   embedding, 0.86-0.91 of a float32 copy of all weights on 12 bfloat16
#   steps of llama3.2_1b, gemma3_1b and gemma_2b); under `fsdp` one of the
#   two gathered copies is in float32. Without these two terms those steps
#   landed at 0.62-0.95x, with them at 0.89-1.08x. A mixture of experts
#   (Mixtral's shapes, 2 of its 32 blocks, on 2x4 and 1x8) keeps a copy of
#   its float32 expert up-projection kernels in another layout, and under
#   `fsdp` no gathered copy of the experts' kernels: 0.67-1.57x before,
#   0.99-1.19x with both.
# - "gpu", "t4" and "tpu": against the peak of the same step compiled for
#   the target by its own compiler on a CPU-only machine (`python -m
#   bench.target_calibration`: libtpu for the TPUs, the JAX CUDA plugin for
#   the GPUs), Adam, real configs (Llama 3 8B and 3.2 1B, Gemma 1B-7B, Qwen
#   2.5 0.5B and 7B, Mixtral 8x7B), LoRA and full, tp and fsdp, 512 to 4096
#   tokens, bfloat16 and float32 (and float16 on a T4); docs/benchmarks.md
#   section 8 has every case. "gpu": 12 steps for eight H100s and the 4
#   steps for one H200 the H200 run measured (where the target compile was
#   1.01-1.09x the device's own peak), all within 15%; the "t4" factors
#   are the GPU compiler's for compute capability 7.5 (its fusions differ,
#   and it computes bfloat16 in float32: `FLOAT32_COMPUTE`); "tpu": 12
#   steps for a v5e-8 and 12 for a v3-8. 19 more steps, not fitted to
#   (`bench.target_calibration --check`: Llama 2 7B, Qwen1.5-MoE, other
#   meshes and lengths), land 14 of 19 within 15%, all within 25%, after
#   `logits_soft_cap`, which only their Gemma 2 steps with the whole
#   vocabulary on each device exercise (one per platform), was set from
#   them. The factors of the terms these
#   cases hardly exercise (per-block masks, the experts' outputs, the
#   final norm) keep the values XLA's GPU fusion is expected to keep.
# - "chunked_head_gradient" (every platform): where the loss is taken in
#   chunks (`loss.chunks`) and the head is trained, its float32 gradient
#   summed over the chunks beside a chunk's own. 1.5, set on CPU from a
#   tiny Gemma (4096-token vocabulary) at 1x1 and 2x4, 0.85 and 0.79x the
#   compiled step without the term, 0.91 and 0.85x with it, and a tiny
#   SmolLM3 on a context mesh of 8 (1.17x at 2); no target's compile has
#   a chunked step with a trained head yet.
# - "chunked_unattributed" (a TPU): the long steps compiled for a v5e
#   (`target_calibration --long`, Gemma 3 1B and Gemma 2B, 8k to 64k
#   tokens) hold about one output embedding's bytes more than the other
#   terms count, with the loss taken in chunks. It is not a copy of the
#   embedding: the compiled programs have none, and halving Gemma 3 1B's
#   vocabulary moves its 16k step's peak by the embedding argument's bytes
#   alone (0.28 GiB). Fitted, 1 on a TPU; unknown elsewhere, so 0.
ACTIVATION_FACTORS = {
    "cpu": {
        "stream": 4,
        "attention": 2,
        "scores": 1.5,
        "scores_one_block": 2,
        "kernel_residuals": 1,
        "masks": 1,
        "mlp": 2,
        "experts": 1,
        "final": 2,
        "logits": 3,
        "logits_whole": 1,
        "logits_float32": 0,
        "logits_soft_cap": 0,
        "gathered_weights": 2,
        "gathered_share": 1,
        "weights_float32": 0.9,
        "gathered_float32": 1,
        "experts_relayout": 1,
        "chunked_head_gradient": 1.5,
        "chunked_unattributed": 0,
    },
    "gpu": {
        "stream": 2,
        "attention": 2,
        "scores": 1,
        "scores_one_block": 0,
        "kernel_residuals": 1,
        "masks": 0,
        "mlp": 1.5,
        "experts": 1,
        "final": 2,
        "logits": 1,
        "logits_whole": 0,
        "logits_float32": 1,
        "logits_soft_cap": 3.5,
        "gathered_weights": 2,
        "gathered_share": 2,
        "weights_float32": 0,
        "gathered_float32": 0,
        "experts_relayout": 0,
        "chunked_head_gradient": 1.5,
        "chunked_unattributed": 0,
    },
    "t4": {
        "stream": 2,
        "attention": 2,
        "scores": 1.5,
        "scores_one_block": 0,
        "kernel_residuals": 1,
        "masks": 0,
        "mlp": 1,
        "experts": 1,
        "final": 2,
        "logits": 3,
        "logits_whole": 0,
        "logits_float32": 1,
        "logits_soft_cap": 1.7,
        "gathered_weights": 1,
        "gathered_share": 0.1,
        "weights_float32": 0.2,
        "gathered_float32": 0,
        "experts_relayout": 0,
        "chunked_head_gradient": 1.5,
        "chunked_unattributed": 0,
    },
    "tpu": {
        "stream": 2,
        "attention": 2,
        "scores": 0.84,
        "scores_one_block": 0,
        "kernel_residuals": 1,
        "masks": 0,
        "mlp": 0.59,
        "experts": 1,
        "final": 2,
        "logits": 1,
        "logits_whole": 0,
        "logits_float32": 1.1,
        "logits_soft_cap": 3,
        "gathered_weights": 0.9,
        "gathered_share": 0.58,
        "weights_float32": 0,
        "gathered_float32": 0,
        "experts_relayout": 0,
        "chunked_head_gradient": 1.5,
        "chunked_unattributed": 1,
    },
}
# Where each device attends a whole sequence with splash (a TPU off a
# context mesh, where the kernel rule takes it), the factors that
# differ from its calibration's. First read from the buffers live at the
# peak of Gemma 3 1B's LoRA step of 8,192 tokens compiled for a v5p: the
# TPU compiler keeps the MLP's outputs and each block's post-norm outputs
# in float32, and no scores. Refitted (`bench.target_calibration --rows
# ... --fit`) to the 27 splash steps of a v5e's target compiles without
# remat, by the program's own peak (`peak_memory_in_bytes`): seven families
# at 1,024 to 8,192 tokens, head dimensions 64 to 256 (64 counted in the
# 128 lanes splash pads it to).
SPLASH_FACTORS = {
    "tpu": {
        "stream": 1.57,
        "attention": 1.36,
        "scores": 0,
        "mlp": 1.38,
        "logits": 0.67,
        "logits_float32": 0,
    }
}
# Under `remat="full"` on a context mesh, how many residual-stream buffers
# each block keeps for its recomputation, by calibration (1 elsewhere).
# Fitted on the steps compiled for a TPU v5e-8 (`bench.target_calibration
# --long`: Gemma 3 1B, Gemma 2B and Llama 3 8B, 131,072 tokens on
# `{"model": 2, "context": 4}`), which one buffer a block left at 0.62-0.77x
# and two bring to 0.91-1.03x: the block's input kept as two 16-bit
# buffers' worth (in float32, as the post-norm outputs splash's steps keep
# are), not yet read from the program's buffers.
CONTEXT_REMAT_STREAMS = {"tpu": 2}
# Under `remat="dots"`, buffers of each weight matmul output a block keeps
# (`remat_memory.saved_dot_elements`), by calibration. One: the elements
# counted are those `jax.ad_checkpoint.print_saved_residuals` lists of
# keras-hub's Gemma, Gemma 2 and 3, Llama and Mixtral blocks (within 2%,
# tests/test_remat_policies.py), and on the CPU each block more of a tiny
# Gemma (hidden 256, MLP 1024, 2 x 256 tokens, 2 and 8 blocks) costs its
# compiled step 3.0 MB beyond "full"'s, what they count in float32 (3.01
# MB). The accelerators' compilers are taken to keep one buffer too: not
# yet measured on their compiles of real configs.
SAVED_DOTS = {"cpu": 1.0, "gpu": 1.0, "t4": 1.0, "tpu": 1.0}
CONTEXT_SPLASH_FACTORS = {"tpu": {"attention": 0.5}}
# Bytes the optimizer's update keeps beside the state, per trained byte,
# when the state is donated (as Keras' JAX trainer does): on CPU, Adam's
# new moments and weights are computed before they replace the old ones
# (1.4x the trained bytes of full fine-tuning steps, above their
# activations at short sequences). Not measured on accelerators, where
# the update is fused in place.
UPDATE_TEMPORARIES = {"cpu": 1.4, "gpu": 0.0, "t4": 0.0, "tpu": 0.0}
# The share of the gradients live beside the activations at the backward
# pass's peak: XLA frees each block's activations as it makes the block's
# gradients, and the TPU compiler applies each weight's update as soon as
# its gradient is made. Full fine-tuning steps compiled for a v3-8 and a
# v5e-8 peak below their weights, gradients and Adam state together (0.97x
# for Gemma 2B in float32 on a v3-8), and Gemma 7B's step for an H200 4%
# above them, with 2.5 GB of activations. Fitted to the target compiles
# (docs/benchmarks.md, section 8); the CPU's factors assume all of them.
GRADIENTS_AT_PEAK = {"cpu": 1.0, "gpu": 0.5, "t4": 0.6, "tpu": 0.2}
# How far the estimate may fall short of (`ESTIMATE_MARGIN`) and exceed
# (`OVER_ESTIMATE_MARGIN`) the compiled peak, per calibration: the closed
# form's worst ratios on the target compiles when each family is left out
# of the factors' fit in turn (`python -m bench.cross_validation`,
# docs/benchmarks.md, section 8): 0.73-1.32x for the GPUs that compute
# bfloat16, 0.77-1.34x for a T4, 0.57-1.50x for the TPUs. `verdicts.
# step_verdict` says "yes" only where the estimate plus its shortfall
# fits, NO only where the estimate less its excess does not, and maybe
# between: a family the factors were not fitted to gets no wrong yes. The
# CPU's estimate is its own compiler's buffers, counted.
ESTIMATE_MARGIN = {"cpu": 0.0, "gpu": 0.38, "t4": 0.30, "tpu": 0.75}
OVER_ESTIMATE_MARGIN = {"cpu": 0.0, "gpu": 0.33, "t4": 0.34, "tpu": 0.51}
FLOAT32_BYTES = 4
FLOAT16_DTYPES = ("bfloat16", "float16")
# The 16-bit float types each compiler computes in float32, by platform or
# named device (`device_profiles`; a device without an entry follows its
# platform): its activations in float32 bytes and its weights converted to
# float32 copies (`FLOAT32_COPY_TERMS`). XLA's CPU backend computes both so.
# A T4 (compute capability 7.5) has no bfloat16 arithmetic: XLA's GPU
# compiler computes a bfloat16 step in float32 (Gemma 2B's LoRA step on 2x
# T4 compiles to 8.63 GB per device in bfloat16, 4.64 GB in float16), and
# Keras' own attention does not compile there (`TargetCompileError`).
FLOAT32_COMPUTE = {"cpu": FLOAT16_DTYPES, "t4": ("bfloat16",)}
# The terms of the float32 copies of 16-bit weights, counted only where the
# model's type is computed in float32.
FLOAT32_COPY_TERMS = ("weights_float32", "gathered_float32")
# The terms of `step_memory.activation_terms`, in the order they are counted.
ACTIVATION_TERMS = tuple(ACTIVATION_FACTORS["cpu"])
# The architectures whose keras-hub attention calls Keras'
# `dot_product_attention` wherever JAX has one: without a fused kernel (on
# a CPU, and in a step compiled for a target from a CPU host) it runs
# `jax.nn.dot_product_attention`'s XLA path, which computes the scores in
# float32 whatever the model's dtype. The others (Gemma 1-4, Mixtral,
# Qwen-MoE) call it only on a GPU or TPU that has a fused kernel, and
# otherwise compute the scores in the model's dtype.
DOT_PRODUCT_ATTENTION = (
    "llama",
    "mistral",
    "phi3",
    "qwen",
    "qwen3",
    "qwen3_moe",
    "smollm3",
)
# Per calibration, the architectures whose attention scores are kept as
# float32 logits beside the probabilities in the model's dtype (4 bytes
# more per score than the model's dtype): XLA's GPU and TPU compilers keep
# both of `jax.nn.dot_product_attention`'s for the backward pass; on a T4
# (float16) and on the CPU (everything in float32) one buffer's worth.
FLOAT32_SCORES = {"gpu": DOT_PRODUCT_ATTENTION, "tpu": DOT_PRODUCT_ATTENTION}
# The terms of `ACTIVATION_FACTORS` that count weights, in bytes.
WEIGHT_TERMS = (
    "gathered_weights",
    "gathered_share",
    "weights_float32",
    "gathered_float32",
    "experts_relayout",
    "chunked_head_gradient",
    "chunked_unattributed",
)
