"""What the dequantizing matmuls (dequant_matmul.py's integer one, fp8_block_matmul.py's) share:
how a call is tiled into programs and K splits, the masked loads and stores of a tile, the
float32 dot, and the pallas_call that runs a kernel over the grid and adds its splits.
Dimensions: M rows of x, I input columns, O outputs, L stacked layers, J K splits.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._paging import (
    MIN_DOT_DIM,
    SUPPORTED_DTYPES,
    next_power_of_2,
)

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
class Tiling:
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


def plan_tiling(
    x: jax.Array,
    num_out: int,
    span: int | None,
    min_sub_k: int,
    block_m: int | None,
    block_o: int | None,
    block_k: int | None,
    num_k_splits: int | None,
    name: str,
) -> Tiling:
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
    return Tiling(num_rows, num_out, block_m, block_o, sub_k, subs_per_step, num_steps, num_splits)


def split_steps(tiling: Tiling) -> tuple[jax.Array, jax.Array]:
    """This program's steps: (first, count), its split's share of the walk over I."""
    steps_per_split = pl.cdiv(tiling.num_steps, tiling.num_splits)
    first = pl.program_id(2) * steps_per_split
    return first, jnp.minimum(tiling.num_steps - first, steps_per_split)


def block_rows(program_axis: int, block: int, num: int) -> tuple[pl.Slice, jax.Array | None]:
    """A block's rows of an axis of `num`: (their slice, which of them exist, or None when all
    do whichever the block)."""
    start = pl.program_id(program_axis) * block
    is_row = None if num % block == 0 else start + jnp.arange(block, dtype=jnp.int32) < num
    return pl.ds(start, block), is_row


def load_tile(ref, index, is_row: jax.Array | None, is_col: jax.Array | None = None):
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


def load_vector(ref, index, is_row: jax.Array | None) -> jax.Array:
    """ref[index] -> [R], reading only rows is_row (None: all)."""
    view = ref.at[index]
    if is_row is None:
        return view[...]
    return pltriton.load(view, mask=is_row, other=jnp.zeros((), view.dtype))


def dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [R, K] . w [C, K] -> f32[R, C]; IEEE float32 for float32 x (Triton's default is TF32)."""
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(
        x, w, _CONTRACT_LAST, precision=precision, preferred_element_type=jnp.float32
    )


def store_rows(out_ref, acc: jax.Array, is_x_row: jax.Array | None) -> None:
    """Writes the block's rows of x that exist: padding rows cost no HBM writes."""
    if is_x_row is None:
        out_ref[...] = acc
    else:
        pltriton.store(out_ref, acc, mask=jnp.broadcast_to(is_x_row[:, None], acc.shape))


def call(
    kernel,
    tiling: Tiling,
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


def validate_x(name: str, x: jax.Array, num_in: int) -> None:
    if x.ndim != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: x must be [M, I] of bfloat16/float16/float32, got {x.dtype}{x.shape}"
        )
    if x.shape[1] != num_in:
        raise ValueError(f"{name}: x has I={x.shape[1]} columns, the weight {num_in}")


def validate_layer(name: str, layer: jax.Array | None, fields: dict[str, jax.Array]) -> None:
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


def own_layer(field: jax.Array | None, layer: jax.Array | None) -> jax.Array | None:
    """[O, ...] as [1, O, ...]: the kernels index a stack of layers."""
    if field is None or layer is not None:
        return field
    return field[None]
