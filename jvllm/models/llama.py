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
    """One decoder layer's weights, projections in the torch layout [out, in] (see dense).

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
    layers: tuple[LayerParams, ...]  # L of them
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to `embed`


def param_shapes(config: ModelConfig) -> Params:
    """The Params `forward` takes, as ShapeDtypeStructs: what every loader must produce."""
    dtype = jnp.dtype(config.dtype)
    d, f, v, h = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    n, k = config.num_heads, config.num_kv_heads

    def shape(*dims: int, dtype: Any = dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype)

    # Norm weights and biases are float32 (see fuse_hf_weights).
    layer = LayerParams(
        input_norm=shape(d, dtype=jnp.float32),
        qkv=shape((n + 2 * k) * h, d),
        qkv_bias=shape((n + 2 * k) * h, dtype=jnp.float32) if config.attention_bias else None,
        q_norm=shape(h, dtype=jnp.float32) if config.qk_norm else None,
        k_norm=shape(h, dtype=jnp.float32) if config.qk_norm else None,
        o=shape(d, n * h),
        post_attention_norm=shape(d, dtype=jnp.float32),
        gate_up=shape(2 * f, d),
        down=shape(d, f),
    )
    return Params(
        embed=shape(v, d),
        layers=(layer,) * config.num_layers,
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


# Not an entry point: a jit inside the traced step makes JAX trace and lower one layer once per
# step shape and call it L times; XLA inlines the calls, so the compiled step is the same as with
# the layer written out L times. Tracing and lowering the written-out layers took 1-2 s of every
# bucket's start-up, from the compilation cache too.
_decoder_layer_traced_once = jax.jit(_decoder_layer, static_argnames=("config", "attn"))


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

    The layers are unrolled, each with its own weight arrays: a `lax.scan` over stacked weights
    slices (copies) every layer's weights each step, which measured 2x slower for a bfloat16
    SmolLM2 decode step on CPU. Each layer's cache scatter updates the donated cache in place.
    """
    x = _embed(params.embed, token_ids)  # [T, D]
    cos, sin = rope_cos_sin(positions, config)  # [T, H] each
    for layer, lp in enumerate(params.layers):
        x, kv_cache = _decoder_layer_traced_once(
            x, kv_cache, lp, jnp.int32(layer), cos, sin, metadata, config=config, attn=attn
        )
    return rms_norm(x, params.final_norm, config.rms_norm_eps), kv_cache


def compute_logits(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden f32[S, D] (already final-normed) -> logits f32[S, V]."""
    head = params.embed if params.lm_head is None else params.lm_head  # [V, D]
    return dense(hidden, head)
