"""The model as the step calls it, on a mesh: `forward` and `logits` over the whole params.

With T = 1 these are models/model.py's functions as they are. With T > 1 each runs inside
`shard_map` over the "model" axis: every device runs `shard_config`'s model on its own slices
of the params and of the KV cache (the attention backend, Pallas kernels included, only ever
sees a device's local heads and pages), and the row-parallel layers all-reduce. The hidden
states leave replicated; the LM head's vocabulary slices are all-gathered into whole logits,
which the sampler (outside shard_map) reads on every device alike.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh, PartitionSpec

from jvllm.config import ModelConfig
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.tensor_parallel import param_specs, params_in_specs, shard_config
from jvllm.layers.hidden_capture import active_capture, capturing_layer_inputs
from jvllm.layers.scan import unstack_specs
from jvllm.models.model import (
    compute_logits,
    forward,
    forward_counting_experts,
    param_axes,
    param_shapes,
)

# The KV cache [L, V, K, P, B, H] is cut on its KV-head axis (a quantized cache's scales
# [L, V, K, P, B] too: the spec is a prefix of both arrays).
KV_CACHE_SPEC = PartitionSpec(None, None, TP_AXIS)


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    # forward(params, kv_cache, token_ids i32[T], positions i32[T], metadata, mm=None)
    #     -> (post-norm hidden f32[T, D], kv_cache); mm: the step's image embeddings
    forward: Callable
    # logits(params, hidden f32[S, D]) -> f32[S, V], whole on every device
    logits: Callable
    # forward's arguments -> (hidden, kv_cache, expert counts i32[L_moe, E]): forward counting
    # each MoE layer's routed tokens (models/model.py); None for a model without routed experts
    forward_counting_experts: Callable | None = None


def sharded_model(
    config: ModelConfig, mesh: Mesh, attn, layers_unstacked: bool, params: dict
) -> ShardedModel:
    """layers_unstacked: whether the params' layers are split (layers/scan.py's
    unstack_layers); params: the params the model runs on (their quantized weights' fields
    each have a spec of their own)."""
    num_shards = mesh.shape[TP_AXIS]
    if num_shards == 1:
        return ShardedModel(
            functools.partial(forward, config=config, attn=attn),
            functools.partial(compute_logits, config=config),
            functools.partial(forward_counting_experts, config=config, attn=attn)
            if config.num_experts
            else None,
        )
    local = shard_config(config, num_shards)
    specs = param_specs(config)
    if layers_unstacked:
        specs = unstack_specs(specs, param_axes(config), param_shapes(config))
    specs = params_in_specs(specs, params)
    whole = PartitionSpec()
    in_specs = (specs, KV_CACHE_SPEC, whole, whole, whole, whole)

    def local_logits(params, hidden):
        logits = compute_logits(params, hidden, config=local)  # [S, V/T]
        return jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)  # [S, padded V]

    gathered = jax.shard_map(
        local_logits, mesh=mesh, in_specs=(specs, whole), out_specs=whole, check_vma=False
    )
    # Every device routes every token alike (expert parallelism too): its expert counts are
    # the global ones, whole on each.
    capturing = functools.partial(_capturing, mesh=mesh, in_specs=in_specs)
    return ShardedModel(
        capturing(forward, config=local, attn=attn, out_specs=(whole, KV_CACHE_SPEC)),
        lambda params, hidden: gathered(params, hidden)[:, : config.vocab_size],
        capturing(
            forward_counting_experts,
            config=local,
            attn=attn,
            out_specs=(whole, KV_CACHE_SPEC, whole),
        )
        if config.num_experts
        else None,
    )


def _capturing(fn, *, config: ModelConfig, attn, mesh: Mesh, in_specs, out_specs) -> Callable:
    """`fn` (forward or forward_counting_experts) inside shard_map over the "model" axis, taking
    its arguments positionally; when the caller traces it under a capture of layers' inputs
    (layers/hidden_capture.py, an EAGLE-3 head's), the rows are captured inside and leave as
    one more output, whole on every device (the hidden states are replicated)."""
    mapped = jax.shard_map(
        functools.partial(fn, config=config, attn=attn),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )

    def capture_inside(layer_ids, *args):
        num_tokens = args[2].shape[0]
        with capturing_layer_inputs(layer_ids, num_tokens, config.hidden_size) as capture:
            out = fn(*args, config=config, attn=attn)
        return (*out, capture.rows)

    def call(params, kv_cache, token_ids, positions, metadata, mm=None):
        args = (params, kv_cache, token_ids, positions, metadata, mm)
        outer = active_capture()
        if outer is None:
            return mapped(*args)
        *out, rows = jax.shard_map(
            functools.partial(capture_inside, outer.layer_ids),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(*out_specs, PartitionSpec()),
            check_vma=False,
        )(*args)
        outer.rows, outer.is_marked = rows, True
        return tuple(out)

    return call
