"""GGUF block formats as they stay packed on a device, and their dequantization in JAX.

A tensor of a block format is a row of blocks per output row; each block encodes
`block_size` values as scales and small integers. On the device a block's bytes are kept as
separate arrays, one per field (e.g. Q4_1: d f16[..., O, nb], m f16[..., O, nb],
qs u8[..., O, nb, 16]), the same bytes as the file, so that a jitted step reads them and
dequantizes a tile where it is used (quantization/packed_weight.py).

Every `_dequantize_*` repeats `gguf.quants`' arithmetic operation for operation (float32
products and sums in its order, never a fused multiply-add), so the values equal
`gguf.quants.dequantize` bit for bit; tests/test_gguf_packed.py checks each type on random
blocks and on the default model's tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGMLQuantizationType as Q

Fields = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    block_size: int  # values per block
    fields: np.dtype  # one block's bytes, as named fields in file order
    # fields with leading dims [..., nb] -> f32[..., nb, block_size]
    dequantize: Callable[[Fields], jax.Array]


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """u8[..., n] -> u8[..., 2n]: the low nibbles, then the high ones."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def _dequantize_q8_0(f: Fields) -> jax.Array:
    return _f32(f["qs"]) * _f32(f["d"])[..., None]


def _dequantize_q4_0(f: Fields) -> jax.Array:
    q = _nibbles(f["qs"])  # byte j holds values j and j + 16
    return _f32(f["d"])[..., None] * _f32(q.astype(jnp.int8) - 8)


def _dequantize_q4_1(f: Fields) -> jax.Array:
    q = _nibbles(f["qs"])
    return _f32(f["d"])[..., None] * _f32(q) + _f32(f["m"])[..., None]


def _fifth_bits(qh: jax.Array) -> jax.Array:
    """u8[..., 4] (a little-endian u32) -> u8[..., 32]: bit j of it at j, shifted to bit 4."""
    bits = qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)  # [..., 4, 8]: byte j // 8
    return ((bits & 1) << 4).reshape(*qh.shape[:-1], 32)


def _dequantize_q5_0(f: Fields) -> jax.Array:
    q = _nibbles(f["qs"]) | _fifth_bits(f["qh"])  # byte j: values j and j + 16
    return _f32(f["d"])[..., None] * _f32(q.astype(jnp.int8) - 16)


def _dequantize_q5_1(f: Fields) -> jax.Array:
    q = _nibbles(f["qs"]) | _fifth_bits(f["qh"])
    return _f32(f["d"])[..., None] * _f32(q) + _f32(f["m"])[..., None]


def _q4_k_scales(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """u8[..., 12] -> (scale, min) u8[..., 8] each: eight 6-bit pairs, the first four in the
    low bits of bytes 0-7, the last four split over bytes 8-11 and the top bits of 0-7."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_bits(f: Fields) -> jax.Array:
    """Q4_K's and Q5_K's low 4 bits -> u8[..., 8, 32]: 32 bytes per pair of sub-blocks, low
    nibbles the first, high nibbles the second."""
    lead = f["qs"].shape[:-1]
    return _nibbles(f["qs"].reshape(*lead, 4, 32)).reshape(*lead, 8, 32)


def _k_scaled(f: Fields, q: jax.Array) -> jax.Array:
    """A K-quant super-block's values u8[..., 8, 32] times their sub-block's scale, less its
    min -> f32[..., 256]."""
    sc, mn = _q4_k_scales(f["scales"])
    d = (_f32(f["d"])[..., None] * _f32(sc))[..., None]  # [..., 8, 1]
    dm = (_f32(f["dmin"])[..., None] * _f32(mn))[..., None]
    return (d * _f32(q) - dm).reshape(*q.shape[:-2], 256)


def _dequantize_q4_k(f: Fields) -> jax.Array:
    return _k_scaled(f, _k_low_bits(f))


def _dequantize_q5_k(f: Fields) -> jax.Array:
    # Sub-block i's fifth bit is bit i of each of qh's 32 bytes.
    high = f["qh"][..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]  # [..., 8, 32]
    return _k_scaled(f, _k_low_bits(f) | ((high & 1) << 4))


def _dequantize_q6_k(f: Fields) -> jax.Array:
    lead = f["ql"].shape[:-1]
    ql = _nibbles(f["ql"].reshape(*lead, 2, 64)).reshape(*lead, 8, 32)  # the low 4 bits
    qh = f["qh"].reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
    qh = (qh & 3).reshape(*lead, 8, 32)  # the high 2 bits
    q = ((ql | (qh << 4)).astype(jnp.int8) - 32).reshape(*lead, 16, 16)
    d = (_f32(f["d"])[..., None] * _f32(f["scales"]))[..., None]  # [..., 16, 1]
    return (d * _f32(q)).reshape(*lead, 256)


BLOCK_FORMATS: dict[Q, BlockFormat] = {
    Q.Q8_0: BlockFormat(32, np.dtype([("d", "<f2"), ("qs", "i1", (32,))]), _dequantize_q8_0),
    Q.Q4_0: BlockFormat(32, np.dtype([("d", "<f2"), ("qs", "u1", (16,))]), _dequantize_q4_0),
    Q.Q4_1: BlockFormat(
        32, np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]), _dequantize_q4_1
    ),
    Q.Q5_0: BlockFormat(
        32, np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]), _dequantize_q5_0
    ),
    Q.Q5_1: BlockFormat(
        32,
        np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
        _dequantize_q5_1,
    ),
    Q.Q4_K: BlockFormat(
        256,
        np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))]),
        _dequantize_q4_k,
    ),
    Q.Q5_K: BlockFormat(
        256,
        np.dtype(
            [
                ("d", "<f2"),
                ("dmin", "<f2"),
                ("scales", "u1", (12,)),
                ("qh", "u1", (32,)),
                ("qs", "u1", (128,)),
            ]
        ),
        _dequantize_q5_k,
    ),
    Q.Q6_K: BlockFormat(
        256,
        np.dtype(
            [("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")]
        ),
        _dequantize_q6_k,
    ),
}
PACKED_QTYPES = tuple(BLOCK_FORMATS)
PACKED_QTYPE_NAMES = tuple(q.name for q in PACKED_QTYPES)


def split_fields(blocks: np.ndarray, qtype: Q) -> dict[str, np.ndarray]:
    """blocks [..., nb] (a structured view of the bytes) -> {field: contiguous array
    [..., nb, *field_shape]} in the field's own dtype (float16 scales, integer quants)."""
    return {name: np.ascontiguousarray(blocks[name]) for name in BLOCK_FORMATS[qtype].fields.names}
