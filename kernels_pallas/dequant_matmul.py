"""A matmul over integer weights kept quantized on the device, dequantized tile by tile inside
the kernel (the role Marlin plays in vLLM): x [M, I] @ W [O, I].T -> [M, O].

- `int_matmul`: 4- or 8-bit integers in jvllm/quantization/int_weight.py's layout: packed
  u8[O, I * bits / 8], scale [O, G] (float16, bfloat16 or float32), zero None or i16[O, G];
  w = (q - z) * s in the scale dtype, then x's dtype.
- its FP8 counterpart, `fp8_block_matmul`, is fp8_block_matmul.py's, on the same tiling
  (_dequant_tiles.py).

One program per (M block, O block, K split) walks its share of I in steps of a few sub-tiles. A
sub-tile's columns lie in one group (one scale block), so its scales and zeros are one vector
over its rows; it is loaded once, converted in registers and multiplied into a float32
accumulator by one dot per sub-tile, so each packed byte is read once and W never exists in HBM.
4-bit: byte b of a 32-column run holds column b in its low nibble and b + 16 in its high one, so
the wrapper splits x's columns the same way (x_lo, x_hi) and the kernel dots each nibble plane
with its own half of x: no interleaving in registers.

Batch-1 decode is memory bound and has few O blocks, so I is split over programs until the GPU
is full (flash decoding's trick); the splits' f32[J, M, O] partial sums are added in plain JAX.
Dimensions: M rows of x, I input columns, O outputs, G groups, L stacked layers, J K splits.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._dequant_tiles import (
    Tiling,
    block_rows,
    call,
    dot,
    load_tile,
    load_vector,
    own_layer,
    plan_tiling,
    split_steps,
    store_rows,
    validate_layer,
    validate_x,
)
from kernels_pallas._paging import MIN_DOT_DIM, SUPPORTED_DTYPES, kernel_scalars, without_operand

NIBBLE_RUN = 32  # int_weight.py's 4-bit runs: low nibbles hold the first 16 columns of 32


def _int_kernel(
    # inputs
    layer_ref,  # i32[1]
    x_ref,  # [2, M, I / 2] at 4 bits (the columns of low and high nibbles), [1, M, I] at 8
    packed_ref,  # u8[L, O, I * bits / 8]
    scale_ref,  # [L, O, G]
    zero_ref,  # i16[L, O, G]; None when symmetric
    # outputs
    out_ref,  # f32[Mb, Ob]: this split's partial sum
    *,
    bits: int,
    group_size: int,
    tiling: Tiling,
):
    layer = layer_ref[0]
    x_rows, is_x_row = block_rows(0, tiling.block_m, tiling.num_rows)
    w_rows, is_w_row = block_rows(1, tiling.block_o, tiling.num_out)
    sub_bytes = tiling.sub_k * bits // 8  # a sub-tile's bytes a row = its columns of a plane
    first, count = split_steps(tiling)

    def step(i, acc):
        for j in range(tiling.subs_per_step):
            sub = (first + i) * tiling.subs_per_step + j
            cols = pl.ds(sub * sub_bytes, sub_bytes)
            group = sub * tiling.sub_k // group_size
            q = load_tile(packed_ref, (layer, w_rows, cols), is_w_row).astype(jnp.int32)
            s = load_vector(scale_ref, (layer, w_rows, group), is_w_row)  # [Ob]
            if zero_ref is None:
                z = jnp.int32(1 << (bits - 1))
            else:
                z = load_vector(zero_ref, (layer, w_rows, group), is_w_row)
                z = z.astype(jnp.int32)[:, None]
            planes = (q & 15, q >> 4) if bits == 4 else (q,)
            for plane, values in enumerate(planes):
                w = ((values - z).astype(s.dtype) * s[:, None]).astype(x_ref.dtype)  # [Ob, C]
                # (an array index: interpret mode's masked load takes no Python int)
                x = load_tile(x_ref, (jnp.int32(plane), x_rows, cols), is_x_row)  # [Mb, C]
                acc += dot(x, w)
        return acc

    acc = lax.fori_loop(0, count, step, jnp.zeros((tiling.block_m, tiling.block_o), jnp.float32))
    store_rows(out_ref, acc, is_x_row)


def _validate_int(
    name: str,
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None,
    bits: int,
    group_size: int,
    layer: jax.Array | None,
) -> None:
    validate_layer(name, layer, {"packed": packed, "scale": scale, "zero": zero})
    if bits not in (4, 8):
        raise ValueError(f"{name}: bits must be 4 or 8, got {bits}")
    if packed.dtype != jnp.uint8:
        raise ValueError(f"{name}: packed must be uint8, got {packed.dtype}")
    num_in = packed.shape[-1] * 8 // bits
    validate_x(name, x, num_in)
    # A sub-tile is a power of two of columns inside one group, at least a dot's 16 per plane.
    min_group = 2 * MIN_DOT_DIM if bits == 4 else MIN_DOT_DIM
    if group_size < min_group or group_size % min_group or num_in % group_size:
        raise ValueError(
            f"{name}: group_size must be a multiple of {min_group} at {bits} bits that divides "
            f"I={num_in}, got {group_size}"
        )
    groups_shape = (*packed.shape[:-1], num_in // group_size)
    if scale.shape != groups_shape or scale.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: scale must be {groups_shape} of float16/bfloat16/float32, "
            f"got {scale.dtype}{scale.shape}"
        )
    if zero is not None and (
        zero.shape != groups_shape or not jnp.issubdtype(zero.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{name}: zero must be None or an integer {groups_shape}, got {zero.dtype}{zero.shape}"
        )


def int_matmul(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None,
    *,
    bits: int,
    group_size: int,
    layer: jax.Array | None = None,
    out_dtype=jnp.float32,
    block_m: int | None = None,
    block_o: int | None = None,
    block_k: int | None = None,
    num_k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """x [M, I] @ W.T -> [M, O] in out_dtype, for the integer weight W of int_weight.py's layout
    (packed u8[O, I * bits / 8], scale [O, I / group_size], zero None or i16[O, I / group_size];
    columns in stored order: a GPTQ act-order weight wants x[:, perm]).

    layer: None, or i32[] (may be traced) when packed, scale and zero are stacked [L, ...]: the
    kernel reads that layer where it lies (a slice inside the layer scan would be a copy).
    block_m, block_o: rows of x and of W per program; block_k: input columns per loop step;
    num_k_splits: programs that share one output block's columns (None: enough to fill the GPU).
    """
    name = "int_matmul"
    _validate_int(name, x, packed, scale, zero, bits, group_size, layer)
    num_rows, num_in = x.shape
    tiling = plan_tiling(
        x,
        packed.shape[-2],
        group_size,
        NIBBLE_RUN if bits == 4 else MIN_DOT_DIM,
        block_m,
        block_o,
        block_k,
        num_k_splits,
        name,
    )
    if bits == 4:
        runs = x.reshape(num_rows, -1, 2, NIBBLE_RUN // 2)  # [M, I / 32, 2, 16]
        x = runs.transpose(2, 0, 1, 3).reshape(2, num_rows, num_in // 2)
    else:
        x = x[None]
    kernel = functools.partial(_int_kernel, bits=bits, group_size=group_size, tiling=tiling)
    operands = [kernel_scalars(0 if layer is None else layer, None), x]
    operands += [own_layer(packed, layer), own_layer(scale, layer)]
    if zero is None:
        kernel = without_operand(kernel, position=4)
    else:
        operands.append(own_layer(zero, layer))
    out = call(
        kernel,
        tiling,
        operands,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name=name,
    )
    return out.astype(out_dtype)


def int_matmul_reference(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None,
    *,
    bits: int,
    group_size: int,
    layer: jax.Array | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """Pure jnp: x @ int_weight.dequantize(...).T, W in x's dtype, accumulated in float32."""
    # Imported here: jvllm imports kernels_pallas, so a module-level import would be circular.
    from jvllm.quantization.int_weight import dequantize

    _validate_int("int_matmul_reference", x, packed, scale, zero, bits, group_size, layer)
    if layer is not None:
        packed, scale = packed[layer], scale[layer]
        zero = None if zero is None else zero[layer]
    w = dequantize(packed, scale, zero, bits).astype(x.dtype)  # [O, I]
    return dot(x, w).astype(out_dtype)
