"""MoE layers across data-parallel ranks (vLLM's data-parallel attention with expert
parallelism over data x tensor, what DeepSeek-class models are served with): one step of the
model for D ranks' batches at once, as one SPMD program over the ("data", "model") mesh.

Rank d owns row d of the mesh, T devices: its batch, its KV pages, and attention, dense layers
and shared experts cut over its T devices as tensor parallelism cuts them (replicated over
"data"). The routed experts are placed whole over all D x T devices (E / (D T) a device,
EXPERT_PARALLEL_RULES), and each MoE layer gathers every rank's tokens and routes over "data",
runs its device's experts on them, and reduce-scatters the partial sums back to their ranks
(layers/parallel.py's experts_over_ranks), or with all2all_backend "ragged_all_to_all" sends
each token only to its experts' devices and the outputs back (layers/expert_dispatch.py;
`choose_all2all_backend` resolves "auto"), before its usual all-reduce over "model". A rank
with nothing to run steps a batch of padding, so that every rank reaches every collective.

The arrays: the step's inputs carry a leading [D] axis cut over "data" (each rank's batch
padded to one bucket); the KV cache [L, V, K, D P, B, H] is cut over "data" on its page axis,
so that each device sees its rank's own pool of P pages with the rank's own page ids; the
outputs have the leading [D] axis again. `jax.shard_map` over both axes runs this (a `vmap`
with `spmd_axis_name` over the ranks cannot wrap the model's shard_map over "model").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm.config import ModelConfig
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs, shard_config
from jvllm.layers.params import DP_AXIS, TP_AXIS
from jvllm.layers.scan import unstack_specs
from jvllm.logger import init_logger
from jvllm.models.model import (
    compute_logits,
    forward,
    forward_counting_experts,
    num_moe_layers,
    param_axes,
    param_shapes,
)

logger = init_logger(__name__)

# The KV cache [L, V, K, D P, B, H] (a quantized cache's scales [L, V, K, D P, B] too): KV heads
# over "model", each rank's P pages over "data".
KV_CACHE_SPEC = PartitionSpec(None, None, TP_AXIS, DP_AXIS)
# Every per-rank input and output: its leading [D] axis over "data".
RANKS_SPEC = PartitionSpec(DP_AXIS)


def ranks_input(mesh: Mesh, local):
    """This process's ranks' stacked inputs [local ranks, ...] -> the group's, every array
    [D, ...] cut over "data" (within one process, the arrays as they are: the step places
    them)."""
    if jax.process_count() == 1:
        return local
    sharding = NamedSharding(mesh, RANKS_SPEC)
    return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a), local)


def local_rank_rows(array: jax.Array, local_ranks: list[int]) -> np.ndarray:
    """An output [D, ...] cut over "data" -> `local_ranks`' rows on the host, in that order."""
    rows = {}
    for shard in array.addressable_shards:
        rows.setdefault(shard.index[0].start or 0, shard.data)
    return np.stack([np.asarray(rows[r])[0] for r in local_ranks])


def rank_config(config: ModelConfig, mesh: Mesh) -> ModelConfig:
    """The model one device of `mesh` runs: its rank's tensor-parallel shard, holding
    E / (D T) experts and running them across the D ranks."""
    local = shard_config(config, mesh.shape[TP_AXIS])
    return dataclasses.replace(local, num_data_ranks=mesh.shape[DP_AXIS])


def choose_all2all_backend(
    config: ModelConfig, mesh: Mesh, all2all_backend: str, num_tokens: int
) -> ModelConfig:
    """`config` (the model's, its experts placed over the D x T `mesh`) with its MoE layers'
    exchange `all2all_backend` (config.py's ALL2ALL_BACKENDS) resolved. "auto" picks the
    ragged all-to-all where it moves fewer bytes than the gather (a token goes to at most
    min(k, D - 1) other ranks, against every D - 1: k < D - 1), the ranks span processes (across
    hosts; within one every form costs under 2 ms a step, and XLA's ragged all-to-all is known
    to use NVLink poorly, openxla/xla#33386) and the devices are not CPUs (where the all-to-all
    is emulated in blocks as large as the gather: ragged_all_to_all.py); else the gather.
    Logged, with the bytes a device would send a step of `num_tokens` tokens a rank by each."""
    num_ranks, top_k = mesh.shape[DP_AXIS], config.num_experts_per_tok
    chosen = all2all_backend
    if all2all_backend == "auto":
        is_cpu = mesh.devices.flat[0].platform == "cpu"
        pays = top_k < num_ranks - 1 and jax.process_count() > 1 and not is_cpu
        chosen = "ragged_all_to_all" if pays else "allgather_reducescatter"
    # A token's row out in the model dtype with its routes, and its partial sum back in float32.
    row_bytes = config.hidden_size * (jnp.dtype(config.dtype).itemsize + 4) + 8 * top_k
    step_bytes = num_tokens * row_bytes * num_moe_layers(config)
    logger.info(
        "all2all_backend=%s: %s for the MoE layers of %d ranks (k = %d); a step of %d tokens "
        "a rank sends up to %.1f MB a device by ragged all-to-all, %.1f MB by all-gather and "
        "reduce-scatter",
        all2all_backend,
        chosen,
        num_ranks,
        top_k,
        num_tokens,
        min(top_k, num_ranks - 1) * step_bytes / 1e6,
        (num_ranks - 1) * step_bytes / 1e6,
    )
    return dataclasses.replace(config, all2all_backend=chosen)


@dataclasses.dataclass(frozen=True)
class DataParallelModel:
    # forward(params, kv_cache, token_ids i32[D, T], positions i32[D, T], metadata)
    #     -> (post-norm hidden f32[D, T, Dh], kv_cache); metadata: each rank's
    #     AttentionMetadata stacked, every array with a leading [D]
    forward: Callable
    # logits(params, hidden f32[D, S, Dh]) -> f32[D, S, V]
    logits: Callable
    # forward's arguments -> (hidden, kv_cache, expert counts i32[D, L_moe, E]): each rank's
    # count of its own tokens' routes (models/model.py's forward_counting_experts)
    forward_counting_experts: Callable


def data_parallel_model(
    config: ModelConfig, mesh: Mesh, attn, layers_unstacked: bool, params: dict
) -> DataParallelModel:
    """`config`: the model's, its experts placed over `mesh` (the D x T one: the loaders'
    expert_parallel_config with num_data_ranks D); layers_unstacked and params as
    sharded_model.py's (the params' placement gives their quantized fields' specs)."""
    local = rank_config(config, mesh)
    specs = param_specs(config)
    if layers_unstacked:
        specs = unstack_specs(specs, param_axes(config), param_shapes(config))
    specs = params_in_specs(specs, params)
    in_specs = (specs, KV_CACHE_SPEC, RANKS_SPEC, RANKS_SPEC, RANKS_SPEC)

    def per_rank(fn):
        """fn over this device's rank's inputs, without their leading [1], and back."""

        def run(params, kv_cache, token_ids, positions, metadata):
            token_ids, positions, metadata = jax.tree.map(
                lambda a: a[0], (token_ids, positions, metadata)
            )
            out = fn(params, kv_cache, token_ids, positions, metadata, config=local, attn=attn)
            hidden, kv_cache, *counts = out
            return hidden[None], kv_cache, *(c[None] for c in counts)

        return run

    mapped = functools.partial(jax.shard_map, mesh=mesh, in_specs=in_specs, check_vma=False)
    model_forward = mapped(per_rank(forward), out_specs=(RANKS_SPEC, KV_CACHE_SPEC))
    counting = mapped(
        per_rank(forward_counting_experts), out_specs=(RANKS_SPEC, KV_CACHE_SPEC, RANKS_SPEC)
    )

    def local_logits(params, hidden):
        logits = compute_logits(params, hidden[0], config=local)  # [S, V/T]
        return jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)[None]  # [1, S, padded V]

    gathered = jax.shard_map(
        local_logits,
        mesh=mesh,
        in_specs=(specs, RANKS_SPEC),
        out_specs=RANKS_SPEC,
        check_vma=False,
    )
    return DataParallelModel(
        model_forward,
        lambda params, hidden: gathered(params, hidden)[..., : config.vocab_size],
        counting,
    )
