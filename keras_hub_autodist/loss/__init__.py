"""The loss: a causal LM's cross-entropy taken a chunk of tokens at a time
(`chunked_cross_entropy`), never over the whole vocabulary's logits at once,
and its installation into a task's training and evaluation steps
(`chunked_steps`, through `compat`). Like the attention kernels, it runs
inside the step on each device; the memory answer (`fitting/`) compiles
the step with it, so this stage comes before that one."""
