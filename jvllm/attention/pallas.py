"""The "pallas" attention backend: kernels_pallas/ behind the model's `attn` contract."""

import jax

from jvllm.attention.kv_pages import write_kv
from jvllm.attention.kv_quant import KVCache, QuantizedKVCache, from_storage
from jvllm.attention.metadata import AttentionMetadata
from kernels_pallas import paged_decode_attention, ragged_paged_attention


def pallas_attention(sm_scale: float, interpret: bool, logit_softcap: float | None = None):
    """Decode buckets (one query per sequence, T == S) use the decode kernel; others the ragged one."""

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

    return attn


def _kernel_operands(kv_cache: KVCache) -> tuple[jax.Array, jax.Array | None]:
    """The cache as the kernels take it -> (values [L, 2, K, P, B, H], scales [L, 2, K, P, B] or
    None); a CPU cache's float8 and bfloat16 bits (attention/kv_quant.py) as those floats."""
    if isinstance(kv_cache, QuantizedKVCache):
        return from_storage(kv_cache.values), from_storage(kv_cache.scales)
    return kv_cache, None
