"""The one collective a model layer issues under tensor parallelism: the all-reduce that ends a
row-parallel projection (attention's o, the MLP's down) or a vocab-sharded embedding lookup.
The layer runs inside `shard_map` over the mesh's "model" axis (distributed/tensor_parallel.py);
with one shard it runs as it is, with no collective."""

import jax

from jvllm.layers.params import TP_AXIS


def sum_over_shards(x: jax.Array, num_shards: int) -> jax.Array:
    """Each device's partial x -> their sum on every device (x itself when num_shards is 1)."""
    return x if num_shards == 1 else jax.lax.psum(x, TP_AXIS)
