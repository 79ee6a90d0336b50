"""Pallas GPU kernels (Triton lowering) for paged attention over the engine's KV cache."""

from kernels_pallas.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]
