"""Attention: the kernels a planned model's attention layers run per device,
and their installation into keras-hub's layers (through `compat`). On a
context mesh each layer takes XLA's attention path (`xla_path`), or attends
per device under `jax.shard_map` (`context_attention`): its block of queries
to keys gathered whole (`blockwise_attention`, or on a TPU the fused
`splash_attention`) or passed around the context axis (`ring_attention`),
with causal work balanced over the devices (`causal_balance`). What one
device holds at once is data the memory estimate reads (`attention_blocks`).
Nothing here lays a weight out: that is the planning stage's."""
