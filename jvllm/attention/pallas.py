"""The "pallas" attention backend: kernels_pallas/ behind the model's `attn` contract."""

import jax
import jax.numpy as jnp

from jvllm.attention.kv_pages import write_kv
from jvllm.attention.kv_quant import KVCache, QuantizedKVCache, from_storage
from jvllm.attention.metadata import AttentionMetadata
from kernels_pallas import (
    mla_decode_attention,
    paged_decode_attention,
    ragged_paged_attention,
    takes_latent_dims,
)


def pallas_attention(
    sm_scale: float,
    interpret: bool,
    logit_softcap: float | None = None,
    latent_dim: int | None = None,
):
    """Decode buckets (one query per sequence, T == S) use the decode kernel; others the ragged one.

    latent_dim: None, or MLA's C for its latent cache [L, 1, 1, P, B, C + R] (layers/mla.py),
    whose decode steps go to the MLA decode kernel, which reads each row once as key and value,
    where it takes the latent's and the rope part's dims (`takes_latent_dims`: powers of two,
    as DeepSeek's 512 + 64); its other steps, and a model of other dims, take the generic
    kernels, which read V as K on a 1-plane cache.
    """

    def attn(
        layer,
        q,
        k,
        v,
        kv_cache: KVCache,
        md: AttentionMetadata,
        sliding_window=None,
        sinks=None,
    ):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        values, scales = _kernel_operands(kv_cache)
        if (
            md.is_decode
            and latent_dim is not None
            and values.shape[1] == 1
            and takes_latent_dims(latent_dim, values.shape[-1])
        ):
            out = mla_decode(q, values, scales, layer, md, sliding_window, sinks)
            return out, kv_cache
        options = {
            "sm_scale": sm_scale,
            "kv_scales": scales,
            "sliding_window": sliding_window,
            "logit_softcap": logit_softcap,
            "sinks": sinks,
            "interpret": interpret,
        }
        if md.is_decode:
            out = paged_decode_attention(q, values, layer, md.block_tables, md.seq_lens, **options)
        else:
            out = ragged_paged_attention(
                q, values, layer, md.block_tables, md.seq_lens, md.query_start_loc, **options
            )
        return out, kv_cache

    def mla_decode(q, values, scales, layer, md, sliding_window, sinks) -> jax.Array:
        """q [S, N, C + R] -> [S, N, C + R]: the kernel's [S, N, C], then zeros in the R dims,
        which the caller drops (as it drops the generic kernels' rope part of V there)."""
        if sliding_window is not None or sinks is not None or logit_softcap is not None:
            raise ValueError("MLA's decode kernel takes no sliding window, sinks or soft cap")
        out = mla_decode_attention(
            q,
            values,
            layer,
            md.block_tables,
            md.seq_lens,
            latent_dim=latent_dim,
            sm_scale=sm_scale,
            kv_scales=scales,
            interpret=interpret,
        )
        return jnp.pad(out, ((0, 0), (0, 0), (0, q.shape[2] - latent_dim)))

    return attn


def _kernel_operands(kv_cache: KVCache) -> tuple[jax.Array, jax.Array | None]:
    """The cache as the kernels take it -> (values [L, 2 or 1, K, P, B, H], scales
    [L, 2 or 1, K, P, B] or None); a CPU cache's float8 and bfloat16 bits
    (attention/kv_quant.py) as those floats."""
    if isinstance(kv_cache, QuantizedKVCache):
        return from_storage(kv_cache.values), from_storage(kv_cache.scales)
    return kv_cache, None
