"""Matmuls over weights kept quantized on the device, dequantized tile by tile inside the kernel
(the role Marlin and the fp8 block-scale kernels play in vLLM): x [M, I] @ W [O, I].T -> [M, O].

- `int_matmul`: 4- or 8-bit integers in jvllm/quantization/int_weight.py's layout: packed
  u8[O, I * bits / 8], scale [O, G] (float16, bfloat16 or float32), zero None or i16[O, G];
  w = (q - z) * s in the scale dtype, then x's dtype.
- `fp8_block_matmul`: float8_e4m3fn values [O, I] and a scale [ceil(O / bo), ceil(I / bi)] per
  static block (bo, bi) (fp8_weight.py's layout); w = values * scale in the scale dtype, then
  x's dtype.

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

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._paging import (
    MIN_DOT_DIM,
    SUPPORTED_DTYPES,
    kernel_scalars,
    next_power_of_2,
    without_operand,
)

NIBBLE_RUN = 32  # int_weight.py's 4-bit runs: low nibbles hold the first 16 columns of 32
# Untimed starting points, for a GPU session to tune (kernels_pallas/bench_dequant_matmul.py):
# 64 x 64 output tiles; 512 input columns a loop step, in sub-tiles of up to 128 (a [64, 64] u8
# load at 4 bits) so that a sub-tile's unpacked planes stay in registers.
_BLOCK_O = 64
_BLOCK_K = 512
_MAX_SUB_K = 128
_MAX_BLOCK_M = 64
# Two waves on a 132-SM H100 / H200; past that, splitting I only adds partial sums to add.
_TARGET_NUM_PROGRAMS = 264
_MAX_K_SPLITS = 16
_CONTRACT_LAST = (((1,), (1,)), ((), ()))  # x [R, K] . w [C, K] -> [R, C]


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """How one call is cut: blocks of x's rows and of W's rows, and the walk over I."""

    num_rows: int  # M
    num_out: int  # O
    block_m: int
    block_o: int
    sub_k: int  # columns of a sub-tile: a power of two inside one group / scale block
    subs_per_step: int  # sub-tiles per loop step, unrolled
    num_steps: int  # the steps cover ceil(I / sub_k) sub-tiles
    num_splits: int  # programs sharing one output block's steps

    @property
    def grid(self) -> tuple[int, int, int]:
        # Row blocks vary fastest, so that programs sharing a weight tile run together.
        num_m_blocks = pl.cdiv(self.num_rows, self.block_m)
        return (num_m_blocks, pl.cdiv(self.num_out, self.block_o), self.num_splits)


def _tiling(
    x: jax.Array,
    num_out: int,
    span: int | None,
    min_sub_k: int,
    block_m: int | None,
    block_o: int | None,
    block_k: int | None,
    num_k_splits: int | None,
    name: str,
) -> _Tiling:
    """span: the columns a sub-tile must not cross (a group, a scale block's columns; a multiple
    of min_sub_k), or None when any sub-tile will do."""
    num_rows, num_in = x.shape
    if block_m is None:
        block_m = min(max(MIN_DOT_DIM, next_power_of_2(num_rows)), _MAX_BLOCK_M)
    block_o = _BLOCK_O if block_o is None else block_o
    block_k = _BLOCK_K if block_k is None else block_k
    for field, value in (("block_m", block_m), ("block_o", block_o), ("block_k", block_k)):
        if value < MIN_DOT_DIM or value & (value - 1):
            raise ValueError(f"{name}: {field} must be a power of two >= 16, got {value}")
    if num_k_splits is not None and num_k_splits < 1:
        raise ValueError(f"{name}: num_k_splits must be >= 1, got {num_k_splits}")
    sub_k = min(_MAX_SUB_K, block_k, next_power_of_2(num_in))
    if span is not None:
        sub_k = min(sub_k, span & -span)  # the largest power of two dividing span
    sub_k = max(sub_k, min_sub_k)
    num_subs = pl.cdiv(num_in, sub_k)
    # Steps of equal length: the most sub-tiles up to block_k columns that divide their number.
    subs_per_step = max(d for d in range(1, max(1, block_k // sub_k) + 1) if num_subs % d == 0)
    num_steps = num_subs // subs_per_step
    if num_k_splits is None:
        num_programs = pl.cdiv(num_rows, block_m) * pl.cdiv(num_out, block_o)
        num_k_splits = min(pl.cdiv(_TARGET_NUM_PROGRAMS, num_programs), _MAX_K_SPLITS)
    # As many splits as shares of equal length need, none left without a step.
    num_splits = pl.cdiv(num_steps, pl.cdiv(num_steps, num_k_splits))
    return _Tiling(num_rows, num_out, block_m, block_o, sub_k, subs_per_step, num_steps, num_splits)


def _split_steps(tiling: _Tiling) -> tuple[jax.Array, jax.Array]:
    """This program's steps: (first, count), its split's share of the walk over I."""
    steps_per_split = pl.cdiv(tiling.num_steps, tiling.num_splits)
    first = pl.program_id(2) * steps_per_split
    return first, jnp.minimum(tiling.num_steps - first, steps_per_split)


def _block_rows(program_axis: int, block: int, num: int) -> tuple[pl.Slice, jax.Array | None]:
    """A block's rows of an axis of `num`: (their slice, which of them exist, or None when all
    do whichever the block)."""
    start = pl.program_id(program_axis) * block
    is_row = None if num % block == 0 else start + jnp.arange(block, dtype=jnp.int32) < num
    return pl.ds(start, block), is_row


def _load_tile(ref, index, is_row: jax.Array | None, is_col: jax.Array | None = None):
    """ref[index] -> [R, C], reading only rows is_row [R] and columns is_col [C] (None: all of
    them) and 0 elsewhere, so that a tile overhanging the array reads nothing past it."""
    view = ref.at[index]
    if is_row is None and is_col is None:
        return view[...]
    mask = jnp.ones(view.shape, jnp.bool_)
    if is_row is not None:
        mask = mask & is_row[:, None]
    if is_col is not None:
        mask = mask & is_col[None, :]
    return pltriton.load(view, mask=mask, other=jnp.zeros((), view.dtype))


def _load_vector(ref, index, is_row: jax.Array | None) -> jax.Array:
    """ref[index] -> [R], reading only rows is_row (None: all)."""
    view = ref.at[index]
    if is_row is None:
        return view[...]
    return pltriton.load(view, mask=is_row, other=jnp.zeros((), view.dtype))


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, K] . w [C, K] -> f32[R, C]; IEEE float32 for float32 x (Triton's default is TF32)."""
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(
        x, w, _CONTRACT_LAST, precision=precision, preferred_element_type=jnp.float32
    )


def _store_rows(out_ref, acc: jax.Array, is_x_row: jax.Array | None) -> None:
    """Writes the block's rows of x that exist: padding rows cost no HBM writes."""
    if is_x_row is None:
        out_ref[...] = acc
    else:
        pltriton.store(out_ref, acc, mask=jnp.broadcast_to(is_x_row[:, None], acc.shape))


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
    tiling: _Tiling,
):
    layer = layer_ref[0]
    x_rows, is_x_row = _block_rows(0, tiling.block_m, tiling.num_rows)
    w_rows, is_w_row = _block_rows(1, tiling.block_o, tiling.num_out)
    sub_bytes = tiling.sub_k * bits // 8  # a sub-tile's bytes a row = its columns of a plane
    first, count = _split_steps(tiling)

    def step(i, acc):
        for j in range(tiling.subs_per_step):
            sub = (first + i) * tiling.subs_per_step + j
            cols = pl.ds(sub * sub_bytes, sub_bytes)
            group = sub * tiling.sub_k // group_size
            q = _load_tile(packed_ref, (layer, w_rows, cols), is_w_row).astype(jnp.int32)
            s = _load_vector(scale_ref, (layer, w_rows, group), is_w_row)  # [Ob]
            if zero_ref is None:
                z = jnp.int32(1 << (bits - 1))
            else:
                z = _load_vector(zero_ref, (layer, w_rows, group), is_w_row)
                z = z.astype(jnp.int32)[:, None]
            planes = (q & 15, q >> 4) if bits == 4 else (q,)
            for plane, values in enumerate(planes):
                w = ((values - z).astype(s.dtype) * s[:, None]).astype(x_ref.dtype)  # [Ob, C]
                # (an array index: interpret mode's masked load takes no Python int)
                x = _load_tile(x_ref, (jnp.int32(plane), x_rows, cols), is_x_row)  # [Mb, C]
                acc += _dot(x, w)
        return acc

    acc = lax.fori_loop(0, count, step, jnp.zeros((tiling.block_m, tiling.block_o), jnp.float32))
    _store_rows(out_ref, acc, is_x_row)


def _fp8_kernel(
    # inputs
    layer_ref,  # i32[1]
    x_ref,  # [M, I]
    values_ref,  # float8_e4m3fn[L, O, I]
    scale_ref,  # [L, ceil(O / bo), ceil(I / bi)]
    # outputs
    out_ref,  # f32[Mb, Ob]: this split's partial sum
    *,
    block: tuple[int, int],
    tiling: _Tiling,
):
    layer = layer_ref[0]
    num_in = values_ref.shape[2]
    sub_k = tiling.sub_k
    x_rows, is_x_row = _block_rows(0, tiling.block_m, tiling.num_rows)
    w_rows, is_w_row = _block_rows(1, tiling.block_o, tiling.num_out)
    # The scale row of each weight row, clamped so that rows past O read a real one.
    rows = pl.program_id(1) * tiling.block_o + jnp.arange(tiling.block_o, dtype=jnp.int32)
    scale_rows = jnp.minimum(rows, tiling.num_out - 1) // block[0]  # [Ob]
    first, count = _split_steps(tiling)

    def step(i, acc):
        for j in range(tiling.subs_per_step):
            sub = (first + i) * tiling.subs_per_step + j
            cols = pl.ds(sub * sub_k, sub_k)
            is_col = None
            if num_in % sub_k:  # the last sub-tile overhangs I
                is_col = sub * sub_k + jnp.arange(sub_k, dtype=jnp.int32) < num_in
            v = _load_tile(values_ref, (layer, w_rows, cols), is_w_row, is_col)  # [Ob, C]
            s = scale_ref[layer, scale_rows, sub * sub_k // block[1]]  # [Ob]
            w = (v.astype(s.dtype) * s[:, None]).astype(x_ref.dtype)
            acc += _dot(_load_tile(x_ref, (x_rows, cols), is_x_row, is_col), w)
        return acc

    acc = lax.fori_loop(0, count, step, jnp.zeros((tiling.block_m, tiling.block_o), jnp.float32))
    _store_rows(out_ref, acc, is_x_row)


def _call(
    kernel,
    tiling: _Tiling,
    operands: list[jax.Array],
    *,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    name: str,
) -> jax.Array:
    """Runs `kernel` over the grid on whole-array operands and adds the splits -> f32[M, O]."""
    num_m_blocks, num_o_blocks, num_splits = tiling.grid
    out_shape = (num_splits, num_m_blocks * tiling.block_m, num_o_blocks * tiling.block_o)
    partial = pl.pallas_call(
        kernel,
        grid=tiling.grid,
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.BlockSpec((None, tiling.block_m, tiling.block_o), lambda m, o, j: (j, m, o)),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*operands)
    return partial[:, : tiling.num_rows, : tiling.num_out].sum(axis=0)


def _validate_x(name: str, x: jax.Array, num_in: int) -> None:
    if x.ndim != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: x must be [M, I] of bfloat16/float16/float32, got {x.dtype}{x.shape}"
        )
    if x.shape[1] != num_in:
        raise ValueError(f"{name}: x has I={x.shape[1]} columns, the weight {num_in}")


def _validate_layer(name: str, layer: jax.Array | None, fields: dict[str, jax.Array]) -> None:
    """Each field is [O, ...], or [L, O, ...] with an integer scalar layer."""
    for field, value in fields.items():
        if value is not None and value.ndim != 2 + (layer is not None):
            stacked = " stacked [L, ...] (a layer is given)" if layer is not None else ""
            raise ValueError(f"{name}: {field} must be 2-D{stacked}, got shape {value.shape}")
    if layer is not None and (
        jnp.shape(layer) not in ((), (1,))
        or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)
    ):
        raise ValueError(f"{name}: layer must be None or an integer scalar, got {layer!r}")


def _own_layer(field: jax.Array | None, layer: jax.Array | None) -> jax.Array | None:
    """[O, ...] as [1, O, ...]: the kernels index a stack of layers."""
    if field is None or layer is not None:
        return field
    return field[None]


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
    _validate_layer(name, layer, {"packed": packed, "scale": scale, "zero": zero})
    if bits not in (4, 8):
        raise ValueError(f"{name}: bits must be 4 or 8, got {bits}")
    if packed.dtype != jnp.uint8:
        raise ValueError(f"{name}: packed must be uint8, got {packed.dtype}")
    num_in = packed.shape[-1] * 8 // bits
    _validate_x(name, x, num_in)
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
    tiling = _tiling(
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
    operands += [_own_layer(packed, layer), _own_layer(scale, layer)]
    if zero is None:
        kernel = without_operand(kernel, position=4)
    else:
        operands.append(_own_layer(zero, layer))
    out = _call(
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
    return _dot(x, w).astype(out_dtype)


def _validate_fp8(
    name: str,
    x: jax.Array,
    values: jax.Array,
    scale: jax.Array,
    block: tuple[int, int],
    layer: jax.Array | None,
) -> None:
    _validate_layer(name, layer, {"values": values, "scale": scale})
    if values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name}: values must be float8_e4m3fn, got {values.dtype}")
    num_out, num_in = values.shape[-2:]
    _validate_x(name, x, num_in)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"{name}: block must be two positive sizes (bo, bi), got {block}")
    # A sub-tile is a power of two of columns (at least a dot's 16) inside one block's columns.
    if block[1] < num_in and block[1] % MIN_DOT_DIM:
        raise ValueError(
            f"{name}: block[1] must be a multiple of {MIN_DOT_DIM} or cover I={num_in}, "
            f"got {block[1]}"
        )
    blocks_shape = (*values.shape[:-2], pl.cdiv(num_out, block[0]), pl.cdiv(num_in, block[1]))
    if scale.shape != blocks_shape or scale.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: scale must be {blocks_shape} of float16/bfloat16/float32 for block "
            f"{block}, got {scale.dtype}{scale.shape}"
        )


def fp8_block_matmul(
    x: jax.Array,
    values: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int],
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
    """x [M, I] @ W.T -> [M, O] in out_dtype, for W = values float8_e4m3fn[O, I] times
    scale [ceil(O / bo), ceil(I / bi)] per block (bo, bi) = `block`: (128, 128) as DeepSeek-V3
    ships, (1, I) per channel, (O, I) per tensor. layer and the tiling as in `int_matmul`."""
    name = "fp8_block_matmul"
    _validate_fp8(name, x, values, scale, block, layer)
    num_in = x.shape[1]
    span = None if block[1] >= num_in else block[1]  # one scale column: any sub-tile will do
    tiling = _tiling(
        x,
        values.shape[-2],
        span,
        MIN_DOT_DIM,
        block_m,
        block_o,
        block_k,
        num_k_splits,
        name,
    )
    kernel = functools.partial(_fp8_kernel, block=tuple(block), tiling=tiling)
    operands = [
        kernel_scalars(0 if layer is None else layer, None),
        x,
        _own_layer(values, layer),
        _own_layer(scale, layer),
    ]
    out = _call(
        kernel,
        tiling,
        operands,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        name=name,
    )
    return out.astype(out_dtype)


def fp8_block_matmul_reference(
    x: jax.Array,
    values: jax.Array,
    scale: jax.Array,
    *,
    block: tuple[int, int],
    layer: jax.Array | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """Pure jnp: x @ fp8_weight.dequantize_blocks(...).T, W in x's dtype, accumulated in f32."""
    from jvllm.quantization.fp8_weight import dequantize_blocks  # see int_matmul_reference

    _validate_fp8("fp8_block_matmul_reference", x, values, scale, block, layer)
    if layer is not None:
        values, scale = values[layer], scale[layer]
    w = dequantize_blocks(values, scale, block).astype(x.dtype)  # [O, I]
    return _dot(x, w).astype(out_dtype)
