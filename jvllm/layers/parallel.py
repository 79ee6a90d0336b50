"""The one collective a model layer issues under tensor parallelism: the all-reduce that ends a
row-parallel projection (attention's o, the MLP's down, a MoE layer's experts) or a
vocab-sharded embedding lookup. The layer runs inside `shard_map` over the mesh's "model" axis
(distributed/tensor_parallel.py); with one shard it runs as it is, with no collective. Under
expert parallelism a MoE layer also asks which of the experts its device holds."""

import jax

from jvllm.layers.params import TP_AXIS


def sum_over_shards(x: jax.Array, num_shards: int) -> jax.Array:
    """Each device's partial x -> their sum on every device (x itself when num_shards is 1)."""
    return x if num_shards == 1 else jax.lax.psum(x, TP_AXIS)


def first_local_expert(num_local_experts: int, num_expert_shards: int) -> jax.Array | None:
    """Under expert parallelism over `num_expert_shards` devices (distributed/expert_parallel.py),
    the router's id i32[] of this device's first expert: device i holds experts
    [i E/T, (i + 1) E/T). None where the layer holds every expert."""
    if num_expert_shards == 1:
        return None
    return jax.lax.axis_index(TP_AXIS) * num_local_experts
