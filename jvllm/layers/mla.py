"""DeepSeek's multi-head latent attention (MLA), with the KV cache holding the latent, as vLLM's
MLA backends serve it, or decompressed, as its non-MLA fallback does (JVLLM_MLA_DISABLE=1).

Glossary: T tokens, D hidden, N heads, P the non-rotated (nope) and R the rotated (rope) dims of
a query/key head, Hv a value head's dims, C the KV latent (kv_lora_rank), Q the query latent
(q_lora_rank).

The latent cache (the default) holds one row of C + R numbers a token and layer: the normed
latent, then the rotated key part that every head shares (DeepSeek-V3: 576, one plane of one
KV head; ModelConfig.kv_planes = 1). The up-projection kv_b [N*(P+Hv), C] is absorbed on both
sides of attention, for prefill and decode alike: each head's nope query meets the latent
through its key projection W_UK [P, C] (q_nope . (W_UK latent) = (q_nope W_UK) . latent), so
attention runs as multi-query attention of N heads of C + R dims over the cached rows, the rows
serving as values too; each head's output, a mix of latents (its first C dims), goes through
its value projection W_UV [Hv, C]. Decode then reads C + R numbers a cached token, not
N * (P + R + Hv).

Decompressed, the latent goes through kv_b into per-head keys and values in the ordinary cache
(two planes of N heads), whose head dim H is max(P + R, Hv): the shorter of key and value is
padded with zeros (a zero dim adds nothing to q . k, and a value's padding is sliced off the
output). For DeepSeek-V3 that is 128 x 192 x 2 numbers a token and layer, 85x the latent's.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.attention.matmul import batched_matmul
from jvllm.config import ModelConfig
from jvllm.layers.attention import AttentionFn
from jvllm.layers.linear import Linear
from jvllm.layers.norm import RMSNorm
from jvllm.layers.rotary import apply_rope
from jvllm.quantization import IntWeight, is_quantized

# HF's DeepseekV2RMSNorm / DeepseekV3RMSNorm default, which the latents' norms keep (they are
# built without the config's rms_norm_eps).
_LATENT_NORM_EPS = 1e-6


def _deinterleave(x: jax.Array) -> jax.Array:
    """x [..., R] with its rotated pairs interleaved ((0, 1), (2, 3), ...) -> the pairs' first
    members, then their second: the rotate-half layout, where apply_rope pairs i with i + R/2.
    q and k both move so, and q . k stays the same."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _weight_array(linear: Linear) -> jax.Array:
    """A Linear's weight [O, I] as an array, its columns in the checkpoint's order: a quantized
    one dequantized in the step (GPTQ act-order stores its columns sorted, `perm`)."""
    w = linear.weight.get_value()
    if isinstance(w, IntWeight):
        return w.dequantize_in_checkpoint_order()
    return w.dequantize() if is_quantized(w) else w[...]


def _pad_to(x: jax.Array, size: int) -> jax.Array:
    """x [T, N, h] -> [T, N, size], zeros after its h dims."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, size - x.shape[-1])))


class MultiHeadLatentAttention(nnx.Module):
    """q from q_proj [N*(P+R), D], or q_a [Q, D] -> RMSNorm -> q_b [N*(P+R), Q] (q_lora_rank);
    kv_a [C + R, D] -> the latent (RMSNorm, then kv_b [N*(P+Hv), C]: each head's key nope part
    and value) | one rotated key part shared by every head; rotary embeddings on the R dims
    only, in HF's layout (`interleaved`: the pairs are neighbours, DeepSeek-V2 always, V3 with
    rope_interleave); then `attn` (over the latent cache, or the decompressed one: see the
    module docstring) and o [D, N*Hv]. HF's attention_bias puts biases on q_a, kv_a and o."""

    def __init__(self, config: ModelConfig):
        d, n = config.hidden_size, config.num_heads
        self.nope_dim = config.option("qk_nope_head_dim")  # P
        self.rope_dim = config.option("qk_rope_head_dim")  # R
        self.v_dim = config.option("v_head_dim")  # Hv
        self.kv_rank = config.option("kv_lora_rank")  # C
        q_rank = config.option("q_lora_rank")  # Q or None
        qk_dim = self.nope_dim + self.rope_dim
        self.num_heads, self.head_dim = n, config.head_dim  # H: the cache's
        self.is_latent_cache = config.kv_planes == 1
        self.interleaved = config.option("rope_interleave", True)
        self.dtype = dtype = jnp.dtype(config.dtype)
        bias = config.attention_bias
        heads = ("heads", "embed")
        if q_rank is None:
            self.q = Linear(d, n * qk_dim, heads, dtype=dtype, segments=((n, qk_dim),))
            self.q_a = self.q_a_norm = None
        else:
            self.q = Linear(q_rank, n * qk_dim, heads, dtype=dtype, segments=((n, qk_dim),))
            self.q_a = Linear(d, q_rank, ("embed", "embed"), dtype=dtype, bias=bias)
            self.q_a_norm = RMSNorm(q_rank, _LATENT_NORM_EPS)
        kv_a_dim = self.kv_rank + self.rope_dim
        self.kv_a = Linear(d, kv_a_dim, ("embed", "embed"), dtype=dtype, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, _LATENT_NORM_EPS)
        kv_b_dim = self.nope_dim + self.v_dim
        kv_b_segments = ((n, kv_b_dim),)
        self.kv_b = Linear(self.kv_rank, n * kv_b_dim, heads, dtype=dtype, segments=kv_b_segments)
        self.o = Linear(
            n * self.v_dim,
            d,
            ("embed", "heads"),
            dtype=dtype,
            bias=bias,
            num_shards=config.num_shards,
        )

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [T, heads, R] rotated in HF's layout -> f32[T, heads, R]."""
        return apply_rope(_deinterleave(x) if self.interleaved else x, cos, sin)

    def __call__(self, x, layer, cos, sin, kv_cache, metadata, attn: AttentionFn):
        """x f32[T, D] (normed) -> (f32[T, D], kv_cache); cos, sin f32[T, R]."""
        num_tokens, n = x.shape[0], self.num_heads
        q_in = x if self.q_a is None else self.q_a_norm(self.q_a(x))  # [T, D] or [T, Q]
        q = self.q(q_in).reshape(num_tokens, n, -1)  # [T, N, P+R]
        q_nope, q_rot = jnp.split(q, [self.nope_dim], axis=-1)
        q_rot = self._rope(q_rot, cos, sin)  # [T, N, R]
        latent, k_rot = jnp.split(self.kv_a(x), [self.kv_rank], axis=-1)  # [T, C], [T, R]
        latent = self.kv_a_norm(latent)
        k_rot = self._rope(k_rot[:, None, :], cos, sin)  # [T, 1, R], shared by the heads
        if self.is_latent_cache:
            out, kv_cache = self._attend_latent(
                q_nope, q_rot, latent, k_rot, layer, kv_cache, metadata, attn
            )
        else:
            out, kv_cache = self._attend_decompressed(
                q_nope, q_rot, latent, k_rot, layer, kv_cache, metadata, attn
            )
        return self.o(out.reshape(num_tokens, n * self.v_dim)), kv_cache

    def _attend_latent(self, q_nope, q_rot, latent, k_rot, layer, kv_cache, metadata, attn):
        """q_nope [T, N, P], q_rot f32[T, N, R], latent f32[T, C], k_rot f32[T, 1, R] ->
        (f32[T, N, Hv], kv_cache): multi-query attention over the cached latent rows."""
        n, c = self.num_heads, self.kv_rank
        kv_b = _weight_array(self.kv_b).reshape(n, -1, c)  # [N, P+Hv, C]
        w_uk, w_uv = jnp.split(kv_b, [self.nope_dim], axis=1)  # [N, P, C], [N, Hv, C]
        # Per head (the batch axis first): XLA:CPU has no bfloat16 dot of other layouts.
        q_latent = batched_matmul(q_nope.swapaxes(0, 1).astype(w_uk.dtype), w_uk)  # [N, T, C]
        q = jnp.concatenate([q_latent.swapaxes(0, 1), q_rot], axis=-1)  # [T, N, C+R]
        row = jnp.concatenate([latent[:, None, :], k_rot], axis=-1).astype(self.dtype)
        out, kv_cache = attn(layer, q.astype(self.dtype), row, row, kv_cache, metadata)
        mixed = out[..., :c].swapaxes(0, 1).astype(w_uv.dtype)  # [N, T, C]: mixes of latents
        out = batched_matmul(mixed, w_uv, y_transposed=True)  # [N, T, Hv]
        return out.swapaxes(0, 1), kv_cache

    def _attend_decompressed(self, q_nope, q_rot, latent, k_rot, layer, kv_cache, metadata, attn):
        """As _attend_latent, through per-head keys and values [T, N, H] in the cache."""
        num_tokens, n, h = q_nope.shape[0], self.num_heads, self.head_dim
        kv = self.kv_b(latent).reshape(num_tokens, n, -1)  # [T, N, P+Hv]
        k_nope, value = jnp.split(kv, [self.nope_dim], axis=-1)  # [T, N, P], [T, N, Hv]
        q = jnp.concatenate([q_nope, q_rot], axis=-1)  # [T, N, P+R]
        k_rot = jnp.broadcast_to(k_rot, (num_tokens, n, self.rope_dim))
        key = jnp.concatenate([k_nope, k_rot], axis=-1)  # [T, N, P+R]
        out, kv_cache = attn(
            layer,
            _pad_to(q, h).astype(self.dtype),
            _pad_to(key, h).astype(self.dtype),
            _pad_to(value, h).astype(self.dtype),
            kv_cache,
            metadata,
        )  # out [T, N, H]
        return out[..., : self.v_dim], kv_cache
