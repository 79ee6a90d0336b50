"""The attention block shared by the families: fused q|k|v, optional q/k norms, rotary
embeddings (none for the learned-position families), the `attn` callable (cache write + paged
attention), output projection."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import NO_WINDOW, ModelConfig
from jvllm.layers.linear import Linear
from jvllm.layers.lora import lora_shape
from jvllm.layers.norm import RMSNorm
from jvllm.layers.params import param
from jvllm.layers.rotary import apply_rope

# attn(layer i32[], q [T, N, H], k [T, K, H], v [T, K, H], kv_cache, metadata[, sliding_window]
#      [, sinks]) -> (out, kv_cache)
AttentionFn = Callable[..., tuple[jax.Array, jax.Array]]


def layer_windows(config: ModelConfig) -> jax.Array | None:
    """i32[L] each layer's sliding window (NO_WINDOW for a global layer), for the layer scan to
    pass as data; None when no layer has a window, so that attention compiles without one."""
    windows = config.layer_windows
    if all(w is None for w in windows):
        return None
    return jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)


class Attention(nnx.Module):
    """q|k|v fused in one projection [(N+2K)*H, D] (with Qwen2's bias), Qwen3's RMSNorm over H on
    q and k (Gemma 3's with `norm_weight_offset` 1), q/k/v clamped where the config's option
    `clip_qkv` says (OLMoE), rotary embeddings unless `rope` is False
    (GPT-2, OPT: positions are learned and added to the input), then the `attn` callable and the
    output projection (with a bias where `output_bias`)."""

    def __init__(
        self,
        config: ModelConfig,
        norm_weight_offset: float = 0.0,
        *,
        rope: bool = True,
        output_bias: bool = False,
        input_size: int | None = None,
    ):
        """`input_size`: q|k|v's input features where not the hidden size (an EAGLE-3 head's
        layer reads its token's embedding and hidden state side by side: 2D)."""
        d, h, n, k = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        dtype = jnp.dtype(config.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.dtype = dtype
        self.qkv = Linear(
            input_size or d,
            (n + 2 * k) * h,
            ("heads", "embed"),
            dtype=dtype,
            bias=config.attention_bias,
            segments=((n, h), (k, h), (k, h)),
            lora=lora_shape(config, num_pieces=3),
        )
        norm = lambda: RMSNorm(h, config.rms_norm_eps, "head_dim", norm_weight_offset)
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        # Hunyuan's q/k norms come after rope, everyone else's before.
        self.norms_after_rope = bool(config.option("qk_norm_after_rope", False))
        self.o = Linear(
            n * h,
            d,
            ("embed", "heads"),
            dtype=dtype,
            bias=output_bias,
            num_shards=config.num_shards,
            lora=lora_shape(config),
        )
        self.rope = rope
        self.is_rope_interleaved = config.is_rope_interleaved
        self.clip_qkv = config.option("clip_qkv")  # OLMoE's: None, or c > 0
        # gpt-oss's sinks: per query head, a logit that joins its softmax with no value.
        is_sinked = config.option("attention_sinks", False)
        self.sinks = param((n,), jnp.float32, ("heads",)) if is_sinked else None

    def __call__(
        self, x, layer, cos, sin, kv_cache, metadata, attn: AttentionFn, sliding_window=None
    ):
        """x f32[T, D] (normed) -> (f32[T, D], kv_cache); cos, sin f32[T, R] over the R rotated
        dims of a head (None without rope; layers/rotary.py), applied after the q/k norms and
        before the cache write, so the attention backends see whole rotated heads;
        sliding_window: None (no window) or this layer's i32[] W (see layer_windows)."""
        num_tokens = x.shape[0]
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)  # [T, (N+2K)*H]
        q, key, value = jnp.split(qkv, [n * h, (n + k) * h], axis=-1)
        q = q.reshape(num_tokens, n, h)  # [T, N, H]
        key = key.reshape(num_tokens, k, h)  # [T, K, H]
        value = value.reshape(num_tokens, k, h)  # [T, K, H]
        if self.q_norm is not None and not self.norms_after_rope:
            q, key = self.q_norm(q), self.k_norm(key)
        if self.clip_qkv is not None:  # clamped to [-c, c] after the q/k norms, as HF's OLMoE
            c = self.clip_qkv
            q, key, value = (jnp.clip(t, -c, c) for t in (q, key, value))
        if self.rope:
            interleaved = self.is_rope_interleaved
            q, key = apply_rope(q, cos, sin, interleaved), apply_rope(key, cos, sin, interleaved)
        if self.q_norm is not None and self.norms_after_rope:
            q, key = self.q_norm(q), self.k_norm(key)
        # q/k/v leave in the model dtype: the cache they are written into has that dtype.
        options = {} if sliding_window is None else {"sliding_window": sliding_window}
        if self.sinks is not None:
            options["sinks"] = self.sinks[...]  # f32[N]
        out, kv_cache = attn(
            layer,
            q.astype(self.dtype),
            key.astype(self.dtype),
            value.astype(self.dtype),
            kv_cache,
            metadata,
            **options,
        )  # out [T, N, H]
        return self.o(out.reshape(num_tokens, n * h)), kv_cache
