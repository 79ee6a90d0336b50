"""x [M, I] @ W.T for W = float8_e4m3fn values [O, I] times a scale [ceil(O / bo),
ceil(I / bi)] per static block (bo, bi) (jvllm/quantization/fp8_weight.py's layout; (1, I) per
channel, (O, I) per tensor), each tile dequantized in registers inside the kernel on
dequant_matmul.py's tiling (_dequant_tiles.py): w = values * scale in the scale dtype, then x's
dtype.
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
    own_layer,
    plan_tiling,
    split_steps,
    store_rows,
    validate_layer,
    validate_x,
)
from kernels_pallas._paging import MIN_DOT_DIM, SUPPORTED_DTYPES, kernel_scalars


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
    tiling: Tiling,
):
    layer = layer_ref[0]
    num_in = values_ref.shape[2]
    sub_k = tiling.sub_k
    x_rows, is_x_row = block_rows(0, tiling.block_m, tiling.num_rows)
    w_rows, is_w_row = block_rows(1, tiling.block_o, tiling.num_out)
    # The scale row of each weight row, clamped so that rows past O read a real one.
    rows = pl.program_id(1) * tiling.block_o + jnp.arange(tiling.block_o, dtype=jnp.int32)
    scale_rows = jnp.minimum(rows, tiling.num_out - 1) // block[0]  # [Ob]
    first, count = split_steps(tiling)

    def step(i, acc):
        for j in range(tiling.subs_per_step):
            sub = (first + i) * tiling.subs_per_step + j
            cols = pl.ds(sub * sub_k, sub_k)
            is_col = None
            if num_in % sub_k:  # the last sub-tile overhangs I
                is_col = sub * sub_k + jnp.arange(sub_k, dtype=jnp.int32) < num_in
            v = load_tile(values_ref, (layer, w_rows, cols), is_w_row, is_col)  # [Ob, C]
            s = scale_ref[layer, scale_rows, sub * sub_k // block[1]]  # [Ob]
            w = (v.astype(s.dtype) * s[:, None]).astype(x_ref.dtype)
            acc += dot(load_tile(x_ref, (x_rows, cols), is_x_row, is_col), w)
        return acc

    acc = lax.fori_loop(0, count, step, jnp.zeros((tiling.block_m, tiling.block_o), jnp.float32))
    store_rows(out_ref, acc, is_x_row)


def _validate_fp8(
    name: str,
    x: jax.Array,
    values: jax.Array,
    scale: jax.Array,
    block: tuple[int, int],
    layer: jax.Array | None,
) -> None:
    validate_layer(name, layer, {"values": values, "scale": scale})
    if values.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name}: values must be float8_e4m3fn, got {values.dtype}")
    num_out, num_in = values.shape[-2:]
    validate_x(name, x, num_in)
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
    tiling = plan_tiling(
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
        own_layer(values, layer),
        own_layer(scale, layer),
    ]
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
    return dot(x, w).astype(out_dtype)
