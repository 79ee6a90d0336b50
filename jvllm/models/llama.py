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
    """Per-layer weights, stacked on a leading L axis so `lax.scan` walks them.

    Projections are fused (q|k|v and gate|up) so each layer does four matmuls, not seven.
    """

    input_norm: jax.Array  # [L, D]
    qkv: jax.Array  # [L, D, (N+2K)*H]
    qkv_bias: jax.Array | None  # [L, (N+2K)*H], Qwen2
    q_norm: jax.Array | None  # [L, H], Qwen3
    k_norm: jax.Array | None  # [L, H], Qwen3
    o: jax.Array  # [L, N*H, D]
    post_attention_norm: jax.Array  # [L, D]
    gate_up: jax.Array  # [L, D, 2F] (gate then up)
    down: jax.Array  # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to `embed`


# XLA:CPU cannot slice or gather bfloat16 natively: a scan over stacked bfloat16 weights (or an
# embedding lookup) converts the whole array to float32 and back on every call (measured: a scan
# 6x slower than slicing uint16). So we slice and gather the bits as uint16 and reinterpret.
def _to_bits(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.uint16) if w.dtype == jnp.bfloat16 else w


def _from_bits(w: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16) if w.dtype == jnp.uint16 else w


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

    Layers run under `lax.scan` with (x, kv_cache) as the carry: the cache scatter then updates
    the carried buffer in place, and compile time does not grow with L as unrolling does.
    """
    x = _from_bits(_to_bits(params.embed)[token_ids]).astype(jnp.float32)  # [T, D]
    cos, sin = rope_cos_sin(positions, config)  # [T, H] each

    def step(carry, xs):
        x, kv_cache = carry
        layer_bits, layer = xs
        lp = jax.tree.map(_from_bits, layer_bits)
        return _decoder_layer(x, kv_cache, lp, layer, cos, sin, metadata, config, attn), None

    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)  # [L]
    layer_bits = jax.tree.map(_to_bits, params.layers)
    (x, kv_cache), _ = jax.lax.scan(step, (x, kv_cache), (layer_bits, layer_ids))
    return rms_norm(x, params.final_norm, config.rms_norm_eps), kv_cache


def compute_logits(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden f32[S, D] (already final-normed) -> logits f32[S, V]."""
    if params.lm_head is not None:
        return dense(hidden, params.lm_head)  # [S, V]
    # Tied head: contract D of embed [V, D] directly rather than materialising embed.T.
    embed = params.embed
    return jax.lax.dot_general(
        hidden.astype(embed.dtype),
        embed,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )  # [S, V]
