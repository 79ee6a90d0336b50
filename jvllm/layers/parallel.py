"""The one collective a model layer issues under tensor parallelism: the all-reduce that ends a
row-parallel projection (attention's o, the MLP's down, a MoE layer's experts) or a
vocab-sharded embedding lookup. The layer runs inside `shard_map` over the mesh's "model" axis
(distributed/tensor_parallel.py); with one shard it runs as it is, with no collective. Under
expert parallelism a MoE layer also asks which of the experts its device holds, and across
data-parallel ranks (distributed/data_parallel_moe.py) runs its experts on every rank's tokens,
gathered or sent to it (layers/expert_dispatch.py)."""

from collections.abc import Callable

import jax

from jvllm.config import ModelConfig
from jvllm.layers.expert_dispatch import dispatch_over_ranks
from jvllm.layers.params import DP_AXIS, TP_AXIS


def sum_over_shards(x: jax.Array, num_shards: int) -> jax.Array:
    """Each device's partial x -> their sum on every device (x itself when num_shards is 1)."""
    return x if num_shards == 1 else jax.lax.psum(x, TP_AXIS)


def gather_over_shards(x: jax.Array, num_shards: int, axis: int) -> jax.Array:
    """Each device's slice of x along `axis` (its share of a vocabulary-cut LM head's logits)
    -> the whole on every device, slices in device order (x itself when num_shards is 1)."""
    return x if num_shards == 1 else jax.lax.all_gather(x, TP_AXIS, axis=axis, tiled=True)


def first_local_expert(
    num_local_experts: int, num_expert_shards: int, num_data_ranks: int = 1
) -> jax.Array | None:
    """Under expert parallelism over `num_expert_shards` devices (distributed/expert_parallel.py),
    the router's id i32[] of this device's first expert: device i holds experts
    [i E/T, (i + 1) E/T), i counting the "model" axis, or with `num_data_ranks` > 1 the
    (data, model) devices row by row. None where the layer holds every expert."""
    if num_expert_shards == 1:
        return None
    axes = (DP_AXIS, TP_AXIS) if num_data_ranks > 1 else TP_AXIS
    return jax.lax.axis_index(axes) * num_local_experts


def experts_over_ranks(
    run: Callable[..., jax.Array],
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    config: ModelConfig,
) -> jax.Array:
    """run(x f32[T, D], weights f32[T, k], experts i32[T, k]) -> this device's experts' partial
    sums f32[T, D], for this rank's T tokens (`config`: the device's layer's). Across its
    num_data_ranks > 1 ranks, by its all2all_backend: "allgather_reducescatter", every rank's
    tokens and routes gathered over "data" ([R T, ...]), run on the device's experts, and the
    partial sums reduce-scattered back, each rank its own T rows summed over the ranks;
    "ragged_all_to_all", each token sent only to the devices of its experts
    (layers/expert_dispatch.py). Either way the "model" axis's sum is the layer's own
    all-reduce, as without ranks. The tokens travel in the model dtype, which the experts'
    grouped matmuls cast them to anyway (bfloat16: half the bytes of float32 rows)."""
    num_ranks = config.num_data_ranks
    if num_ranks == 1:
        return run(x, weights, experts)
    if config.all2all_backend == "ragged_all_to_all":
        return dispatch_over_ranks(
            run, x, weights, experts, num_ranks, config.num_local_experts, config.dtype
        )
    rows = x.astype(config.dtype)
    everyone = jax.lax.all_gather((rows, weights, experts), DP_AXIS, tiled=True)
    return jax.lax.psum_scatter(run(*everyone), DP_AXIS, scatter_dimension=0, tiled=True)
