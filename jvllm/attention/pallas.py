"""The "pallas" attention backend: kernels_pallas/ behind the model's `attn` contract."""

from jvllm.attention.metadata import AttentionMetadata
from jvllm.attention.reference import write_kv
from kernels_pallas import paged_decode_attention, ragged_paged_attention


def pallas_attention(sm_scale: float, interpret: bool, logit_softcap: float | None = None):
    """Decode buckets (one query per sequence, T == S) use the decode kernel; others the ragged one."""

    def attn(layer, q, k, v, kv_cache, md: AttentionMetadata, sliding_window=None):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        options = {
            "sm_scale": sm_scale,
            "sliding_window": sliding_window,
            "logit_softcap": logit_softcap,
            "interpret": interpret,
        }
        if md.is_decode:
            out = paged_decode_attention(
                q, kv_cache, layer, md.block_tables, md.seq_lens, **options
            )
        else:
            out = ragged_paged_attention(
                q, kv_cache, layer, md.block_tables, md.seq_lens, md.query_start_loc, **options
            )
        return out, kv_cache

    return attn
