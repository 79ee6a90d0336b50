"""Pallas GPU kernels (Triton lowering) for paged attention over the engine's KV cache."""

from kernels_pallas._paging import is_supported_page_size
from kernels_pallas.mla_decode_attention import (
    mla_decode_attention,
    mla_decode_attention_reference,
    takes_latent_dims,
)
from kernels_pallas.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "is_supported_page_size",
    "mla_decode_attention",
    "mla_decode_attention_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "takes_latent_dims",
]
