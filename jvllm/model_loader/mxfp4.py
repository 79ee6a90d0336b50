"""MXFP4-packed checkpoint tensors (quantization_config quant_method "mxfp4", gpt-oss's experts)
dequantized to float32 at load, as HF transformers' `convert_moe_packed_tensors` makes them.

Such a checkpoint stores a tensor NAME as NAME_blocks and NAME_scales, for an [..., out, in]
weight:
    blocks u8[..., out, in / 32, 16]   two fp4 e2m1 values a byte, the low nibble first
    scales u8[..., out, in / 32]       one e8m0 exponent (biased by 127) per block of 32 values
and the value is e2m1 * 2**(scale - 127). HF hands the result over transposed, [..., in, out],
which is the layout the unpacked checkpoint's parameter has (gpt-oss's gate_up_proj [E, D, 2F],
down_proj [E, F, D]), so a family reads NAME the same way whether it was packed or not.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
_E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_SCALE_BIAS = 127
_BLOCK_BYTES = 16  # 32 values


def packed_names(name: str) -> tuple[str, str]:
    """The (blocks, scales) tensor names an MXFP4 checkpoint stores tensor `name` as."""
    return name + BLOCKS_SUFFIX, name + SCALES_SUFFIX


def read_packed(tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    """Tensor `name` dequantized from its MXFP4 pair in `tensors`; None when it has none."""
    blocks, scales = packed_names(name)
    if blocks not in tensors or scales not in tensors:
        return None
    return dequantize_mxfp4(tensors[blocks], tensors[scales])


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[..., O, G, 16], scales u8[..., O, G] -> f32[..., G * 32, O] (see the module
    docstring).

    `np.ldexp` scales as HF's `torch.ldexp` does, so the values are bit for bit HF's float32
    ones, and exact in bfloat16 too for the exponents checkpoints hold. One leading index at a
    time, so that the temporaries stay small.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.ndim < 3 or blocks.shape[-1] != _BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., O, G, {_BLOCK_BYTES}] and scales [..., O, G] do not match: "
            f"got {blocks.shape} and {scales.shape}"
        )
    *lead, num_out, num_groups, _ = blocks.shape
    out = np.empty((*lead, num_out, num_groups * 2 * _BLOCK_BYTES), np.float32)
    flat_blocks = blocks.reshape(-1, num_out, num_groups, _BLOCK_BYTES)
    flat_scales = scales.reshape(-1, num_out, num_groups)
    flat_out = out.reshape(-1, num_out, num_groups, 2 * _BLOCK_BYTES)
    for i in range(len(flat_blocks)):
        packed, values = flat_blocks[i], flat_out[i]  # [O, G, 16], [O, G, 32]
        values[..., 0::2] = _E2M1_VALUES[packed & 0x0F]
        values[..., 1::2] = _E2M1_VALUES[packed >> 4]
        exponents = flat_scales[i].astype(np.int32) - _SCALE_BIAS  # [O, G]
        np.ldexp(values, exponents[..., None], out=values)
    return out.swapaxes(-1, -2)
