"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as pure functions.

The contract is in docs/design.md: `forward` runs the decoder over flattened tokens and returns
the post-norm hidden states and the updated KV cache; `compute_logits` applies the LM head to the
rows that sample. Attention itself (cache write + paged attention) is the `attn` callable the
caller passes in, so this file knows nothing about pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.layers.linear import dense
from jvllm.layers.norm import rms_norm
from jvllm.layers.rotary import apply_rope, rope_cos_sin

# attn(layer i32[], q [T, N, H], k [T, K, H], v [T, K, H], kv_cache, metadata) -> (out, kv_cache)
AttentionFn = Callable[
    [jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array]
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """The decoder layers' weights, each stacked on a leading layer axis [L, ...] (the KV cache
    has one too), projections in the torch layout [out, in] (see dense). `forward` scans over
    the layer axis; inside the scan each field holds one layer's slice (the shapes below).

    Projections are fused (q|k|v and gate|up) so each layer does four matmuls, not seven.
    """

    input_norm: jax.Array  # [D]
    qkv: jax.Array  # [(N+2K)*H, D]
    qkv_bias: jax.Array | None  # [(N+2K)*H], Qwen2
    q_norm: jax.Array | None  # [H], Qwen3
    k_norm: jax.Array | None  # [H], Qwen3
    o: jax.Array  # [D, N*H]
    post_attention_norm: jax.Array  # [D]
    gate_up: jax.Array  # [2F, D] (gate then up)
    down: jax.Array  # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams  # every field [L, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to `embed`


def param_shapes(config: ModelConfig) -> Params:
    """The Params `forward` takes, as ShapeDtypeStructs: what every loader must produce."""
    dtype = jnp.dtype(config.dtype)
    d, f, v, h = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    n, k = config.num_heads, config.num_kv_heads

    def shape(*dims: int, dtype: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype)

    def stacked(*dims: int, dtype: Any = dtype) -> jax.ShapeDtypeStruct:
        return shape(config.num_layers, *dims, dtype=dtype)

    # Norm weights and biases are float32 (see fuse_hf_weights).
    layers = LayerParams(
        input_norm=stacked(d, dtype=jnp.float32),
        qkv=stacked((n + 2 * k) * h, d),
        qkv_bias=stacked((n + 2 * k) * h, dtype=jnp.float32) if config.attention_bias else None,
        q_norm=stacked(h, dtype=jnp.float32) if config.qk_norm else None,
        k_norm=stacked(h, dtype=jnp.float32) if config.qk_norm else None,
        o=stacked(d, n * h),
        post_attention_norm=stacked(d, dtype=jnp.float32),
        gate_up=stacked(2 * f, d),
        down=stacked(d, f),
    )
    return Params(
        embed=shape(v, d),
        layers=layers,
        final_norm=shape(d, dtype=jnp.float32),
        lm_head=None if config.tie_word_embeddings else shape(v, d),
    )


def _embed(embed: jax.Array, token_ids: jax.Array) -> jax.Array:
    """embed[token_ids] as float32 [T, D]. XLA:CPU cannot gather bfloat16 natively (it converts
    the whole table to float32 and back each call), so a bfloat16 table is gathered as uint16."""
    if embed.dtype != jnp.bfloat16:
        return embed[token_ids].astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(embed, jnp.uint16)[token_ids]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def _decoder_layer(
    x: jax.Array,
    kv_cache: jax.Array,
    lp: LayerParams,
    layer: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    metadata: Any,
    config: ModelConfig,
    attn: AttentionFn,
) -> tuple[jax.Array, jax.Array]:
    """One pre-norm block on the f32 residual stream x [T, D]; `lp` holds one layer's slices."""
    num_tokens = x.shape[0]
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = jnp.dtype(config.dtype)

    qkv = dense(rms_norm(x, lp.input_norm, config.rms_norm_eps), lp.qkv)  # [T, (N+2K)*H]
    if lp.qkv_bias is not None:
        qkv = qkv + lp.qkv_bias.astype(jnp.float32)
    q, key, value = jnp.split(qkv, [n * h, (n + k) * h], axis=-1)
    q = q.reshape(num_tokens, n, h)  # [T, N, H]
    key = key.reshape(num_tokens, k, h)  # [T, K, H]
    value = value.reshape(num_tokens, k, h)  # [T, K, H]
    if lp.q_norm is not None:
        q = rms_norm(q, lp.q_norm, config.rms_norm_eps)
        key = rms_norm(key, lp.k_norm, config.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    key = apply_rope(key, cos, sin)
    # q/k/v leave in the model dtype: the cache they are written into has that dtype.
    out, kv_cache = attn(
        layer, q.astype(dtype), key.astype(dtype), value.astype(dtype), kv_cache, metadata
    )  # out [T, N, H]
    x = x + dense(out.reshape(num_tokens, n * h), lp.o)  # [T, D]

    gate_up = dense(rms_norm(x, lp.post_attention_norm, config.rms_norm_eps), lp.gate_up)
    gate, up = jnp.split(gate_up, 2, axis=-1)  # [T, F] each
    x = x + dense(jax.nn.silu(gate) * up, lp.down)  # [T, D]
    return x, kv_cache


def forward(
    params: Params,
    kv_cache: jax.Array,
    token_ids: jax.Array,
    positions: jax.Array,
    metadata: Any,
    *,
    config: ModelConfig,
    attn: AttentionFn,
) -> tuple[jax.Array, jax.Array]:
    """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache).

    The layers run as one `lax.scan`, so a compiled step holds the layer once, not L times
    (SmolLM2's 30 layers: 3-5x less compile time a bucket; docs/design.md "Layer scan"). Each
    layer's cache scatter updates the donated cache, carried through the scan, in place.
    """
    x = _embed(params.embed, token_ids)  # [T, D]
    cos, sin = rope_cos_sin(positions, config)  # [T, H] each

    def layer_step(carry, layer):
        x, kv_cache = carry
        # The barrier ties the stacked weights to the layer index, so that XLA cannot hoist
        # work on them out of the loop: it converted every bfloat16 layer to float32 before the
        # loop, each step (a SmolLM2 decode step 15x slower on CPU).
        layers, layer = jax.lax.optimization_barrier((params.layers, layer))
        lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), layers)
        if x.shape[0] == 1 and lp.qkv.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            # One row on CPU: copy the slice as it is, so the float32 conversion stays fused
            # into the multiply-reduce that reads it (see dense); XLA:CPU would otherwise write
            # the slice out converted to float32 in a slow fusion (batch-1 decode: 36 against
            # 3 tok/s). A GPU reads the slice in place, where a copy would add weight traffic.
            lp = jax.lax.optimization_barrier(lp)
        return _decoder_layer(x, kv_cache, lp, layer, cos, sin, metadata, config, attn), None

    layers = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, kv_cache), _ = jax.lax.scan(layer_step, (x, kv_cache), layers)
    return rms_norm(x, params.final_norm, config.rms_norm_eps), kv_cache


def compute_logits(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden f32[S, D] (already final-normed) -> logits f32[S, V]."""
    head = params.embed if params.lm_head is None else params.lm_head  # [V, D]
    return dense(hidden, head)
