"""int_matmul and fp8_block_matmul in interpret mode against their pure-jnp references (CPU), and
their lowering for CUDA (Triton) at an 8B model's shapes, through an abstract H100."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.quantization.fp8_weight import dequantize_blocks
from jvllm.quantization.int_weight import dequantize, pack
from kernels_pallas.dequant_matmul import int_matmul, int_matmul_reference
from kernels_pallas.fp8_block_matmul import fp8_block_matmul, fp8_block_matmul_reference
from kernels_pallas.lowering import lower_for_cuda, num_triton_calls

SDS = jax.ShapeDtypeStruct
# Kernel and reference multiply the same dequantized values (x's dtype, exact products in float32)
# and differ only in the order of their float32 sums: an error well inside n * eps32 of the sum
# of |x_i * w_i| (the bound of any summation order) for the sizes here.
ACCUMULATION_RTOL = 2e-6


def _int_case(
    seed: int,
    num_rows: int,
    num_out: int,
    num_in: int,
    bits: int,
    group_size: int,
    is_symmetric: bool,
    scale_dtype,
    x_dtype=jnp.bfloat16,
    num_layers: int | None = None,
):
    """(x [M, I], packed, scale, zero) of a random weight, stacked [L, ...] with num_layers."""
    rng = np.random.default_rng(seed)
    lead = () if num_layers is None else (num_layers,)
    num_groups = num_in // group_size
    q = rng.integers(0, 1 << bits, (*lead, num_out, num_in))
    scale = rng.uniform(0.5, 2.0, (*lead, num_out, num_groups)) / (1 << bits)
    # GPTQ's v1 zero points reach 2^bits.
    zero = None if is_symmetric else rng.integers(0, (1 << bits) + 1, (*lead, num_out, num_groups))
    return (
        jnp.asarray(rng.standard_normal((num_rows, num_in)), x_dtype),
        jnp.asarray(pack(q, bits)),
        jnp.asarray(scale, scale_dtype),
        None if zero is None else jnp.asarray(zero, jnp.int16),
    )


def _fp8_case(
    seed: int,
    num_rows: int,
    num_out: int,
    num_in: int,
    block: tuple[int, int],
    scale_dtype,
    x_dtype=jnp.bfloat16,
    num_layers: int | None = None,
):
    """(x [M, I], values, scale) of a random fp8 weight, stacked [L, ...] with num_layers."""
    rng = np.random.default_rng(seed)
    lead = () if num_layers is None else (num_layers,)
    values = rng.standard_normal((*lead, num_out, num_in)) * 100  # e4m3 reaches 448
    scale_shape = (*lead, -(-num_out // block[0]), -(-num_in // block[1]))
    return (
        jnp.asarray(rng.standard_normal((num_rows, num_in)), x_dtype),
        jnp.asarray(values, jnp.float8_e4m3fn),
        jnp.asarray(rng.uniform(1e-3, 1e-2, scale_shape), scale_dtype),
    )


def _assert_close(out: jax.Array, ref: jax.Array, bound: jax.Array):
    """out vs ref [M, O]; bound: sum over i of |x_i * w_i| per output, in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape and np.isfinite(out).all()
    np.testing.assert_array_less(np.abs(out - ref), ACCUMULATION_RTOL * bound + 1e-30)


def _abs_bound(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T


def _check_int(args, *, bits: int, group_size: int, **options):
    x, packed, scale, zero = args
    out = int_matmul(*args, bits=bits, group_size=group_size, interpret=True, **options)
    ref = int_matmul_reference(*args, bits=bits, group_size=group_size)
    assert out.dtype == jnp.float32 and out.shape == (x.shape[0], packed.shape[0])
    _assert_close(out, ref, _abs_bound(x, _int_dense(packed, scale, zero, bits, x.dtype)))
    return out


def _int_dense(packed, scale, zero, bits, dtype):
    return dequantize(packed, scale, zero, bits).astype(dtype)


def _check_fp8(args, *, block: tuple[int, int], **options):
    x, values, scale = args
    out = fp8_block_matmul(*args, block=block, interpret=True, **options)
    ref = fp8_block_matmul_reference(*args, block=block)
    assert out.dtype == jnp.float32 and out.shape == (x.shape[0], values.shape[0])
    w = dequantize_blocks(values, scale, block).astype(x.dtype)
    _assert_close(out, ref, _abs_bound(x, w))


# (bits, group size (None: the whole row), symmetric, scale dtype, M, O, I): M of 1, 5 and 40
# rows; O and I not multiples of the 64-row / 512-column blocks.
INT_CASES = [
    (4, 128, True, jnp.float16, 1, 72, 256),
    (4, 32, False, jnp.bfloat16, 5, 100, 192),
    (4, 64, False, jnp.float16, 40, 24, 192),
    (4, None, True, jnp.bfloat16, 5, 80, 96),
    (4, 128, False, jnp.bfloat16, 40, 130, 384),
    (8, 128, False, jnp.float16, 1, 100, 256),
    (8, 32, True, jnp.bfloat16, 40, 72, 160),
    (8, 64, True, jnp.float16, 5, 130, 128),
    (8, None, False, jnp.bfloat16, 1, 50, 80),
]


@pytest.mark.parametrize(
    ("bits", "group_size", "is_symmetric", "scale_dtype", "num_rows", "num_out", "num_in"),
    INT_CASES,
)
def test_int_matmul_matches_reference_on_ragged_shapes(
    bits, group_size, is_symmetric, scale_dtype, num_rows, num_out, num_in
):
    group_size = num_in if group_size is None else group_size
    args = _int_case(0, num_rows, num_out, num_in, bits, group_size, is_symmetric, scale_dtype)
    _check_int(args, bits=bits, group_size=group_size)


def test_int_matmul_in_float32_with_float32_scales():
    args = _int_case(1, 5, 72, 128, 4, 64, False, jnp.float32, x_dtype=jnp.float32)
    _check_int(args, bits=4, group_size=64)


@pytest.mark.parametrize("num_k_splits", [1, 3, None])
def test_int_matmul_is_independent_of_the_walk_over_the_input(num_k_splits):
    """Steps of 64 columns (one group each), shared by 1, 3 (of 3, 3, 2 steps) or the default
    number of programs, in blocks of 16 rows."""
    args = _int_case(2, 3, 40, 512, 4, 64, False, jnp.bfloat16)
    _check_int(args, bits=4, group_size=64, block_k=64, block_o=16, num_k_splits=num_k_splits)


def test_int_matmul_reads_a_traced_layer_of_a_stack():
    x, *fields = _int_case(3, 5, 72, 128, 4, 32, False, jnp.float16, num_layers=3)
    kernel = jax.jit(functools.partial(int_matmul, bits=4, group_size=32, interpret=True))
    out = kernel(x, *fields, layer=jnp.int32(2))
    own = [f[2] for f in fields]
    ref = int_matmul_reference(x, *own, bits=4, group_size=32)
    _assert_close(out, ref, _abs_bound(x, _int_dense(*own, 4, x.dtype)))
    stacked_ref = int_matmul_reference(x, *fields, bits=4, group_size=32, layer=jnp.int32(2))
    np.testing.assert_array_equal(np.asarray(stacked_ref), np.asarray(ref))


# (block, scale dtype, x dtype, M): DeepSeek-V3's 128 x 128 blocks, per channel, per tensor, on
# O = 200 and I = 328 (neither a multiple of 128 nor of the kernel's blocks).
FP8_CASES = [
    ((128, 128), jnp.float32, jnp.bfloat16, 5),
    ((1, 328), jnp.bfloat16, jnp.bfloat16, 1),
    ((200, 328), jnp.float32, jnp.float32, 40),
]


@pytest.mark.parametrize(("block", "scale_dtype", "x_dtype", "num_rows"), FP8_CASES)
def test_fp8_block_matmul_matches_reference_on_ragged_shapes(block, scale_dtype, x_dtype, num_rows):
    args = _fp8_case(4, num_rows, 200, 328, block, scale_dtype, x_dtype)
    _check_fp8(args, block=block)


def test_fp8_block_matmul_reads_a_traced_layer_of_a_stack():
    block = (32, 64)
    x, values, scale = _fp8_case(5, 3, 72, 192, block, jnp.float32, num_layers=2)
    kernel = jax.jit(functools.partial(fp8_block_matmul, block=block, interpret=True))
    out = kernel(x, values, scale, layer=jnp.int32(1))
    ref = fp8_block_matmul_reference(x, values, scale, block=block, layer=jnp.int32(1))
    _check_fp8((x, values[1], scale[1]), block=block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "bits": 3}, "bits must be 4 or 8"),
        (lambda a: {**a, "group_size": 48}, "group_size must be a multiple of 32"),
        (lambda a: {**a, "group_size": 96}, "group_size must be a multiple of 32"),
        (lambda a: {**a, "x": a["x"][:, :64]}, "x has I=64"),
        (lambda a: {**a, "x": a["x"].astype(jnp.int8)}, "x must be"),
        (lambda a: {**a, "packed": a["packed"].astype(jnp.int8)}, "packed must be uint8"),
        (lambda a: {**a, "scale": a["scale"][:, :1]}, "scale must be"),
        (lambda a: {**a, "zero": a["zero"].astype(jnp.float32)}, "zero must be"),
        (lambda a: {**a, "layer": jnp.int32(0)}, "stacked"),
        (lambda a: {**a, "block_o": 48}, "block_o must be a power of two"),
        (lambda a: {**a, "num_k_splits": 0}, "num_k_splits"),
    ],
)
def test_int_matmul_rejects_bad_inputs_with_a_clear_error(change, message):
    x, packed, scale, zero = _int_case(6, 2, 16, 128, 4, 64, False, jnp.float16)
    args = {"x": x, "packed": packed, "scale": scale, "zero": zero, "bits": 4, "group_size": 64}
    with pytest.raises(ValueError, match=message):
        int_matmul(**change(args), interpret=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "values": a["values"].astype(jnp.bfloat16)}, "float8_e4m3fn"),
        (lambda a: {**a, "block": (128, 24)}, "block\\[1\\] must be a multiple of 16"),
        (lambda a: {**a, "block": (64, 64)}, "scale must be"),
        (lambda a: {**a, "x": a["x"][:, :100]}, "x has I=100"),
    ],
)
def test_fp8_block_matmul_rejects_bad_inputs_with_a_clear_error(change, message):
    x, values, scale = _fp8_case(7, 2, 200, 328, (128, 128), jnp.float32)
    args = {"x": x, "values": values, "scale": scale, "block": (128, 128)}
    with pytest.raises(ValueError, match=message):
        fp8_block_matmul(**change(args), interpret=True)


# Llama-3-8B's projections (I -> O): qkv, gate / up, down.
LLAMA_8B = [(4096, 6144), (4096, 28672), (14336, 4096)]


@pytest.mark.parametrize(("num_in", "num_out"), LLAMA_8B)
@pytest.mark.parametrize(("bits", "is_symmetric"), [(4, True), (4, False), (8, False)])
@pytest.mark.parametrize("num_rows", [1, 16, 300])
def test_int_matmul_lowers_for_cuda(num_in, num_out, bits, is_symmetric, num_rows):
    group_size = 128
    groups = SDS((num_out, num_in // group_size), jnp.float16)
    lowered = lower_for_cuda(
        functools.partial(int_matmul, bits=bits, group_size=group_size),
        SDS((num_rows, num_in), jnp.bfloat16),
        SDS((num_out, num_in * bits // 8), jnp.uint8),
        groups,
        None if is_symmetric else SDS(groups.shape, jnp.int16),
    )
    assert num_triton_calls(lowered) == 1


def test_int_matmul_of_a_stacked_whole_row_weight_lowers_for_cuda():
    num_layers, num_in, num_out = 32, 4096, 6144
    lowered = lower_for_cuda(
        lambda x, packed, scale, layer: int_matmul(
            x, packed, scale, None, bits=4, group_size=num_in, layer=layer
        ),
        SDS((1, num_in), jnp.bfloat16),
        SDS((num_layers, num_out, num_in // 2), jnp.uint8),
        SDS((num_layers, num_out, 1), jnp.bfloat16),
        SDS((), jnp.int32),
    )
    assert num_triton_calls(lowered) == 1


# DeepSeek-V3's q_a / kv_a projection (7168 -> 2112, not a multiple of 128 rows) in its
# 128 x 128 blocks, and an 8B's down projection per channel and per tensor.
@pytest.mark.parametrize(
    ("num_in", "num_out", "block", "scale_dtype"),
    [
        (7168, 2112, (128, 128), jnp.float32),
        (14336, 4096, (1, 14336), jnp.bfloat16),
        (14336, 4096, (4096, 14336), jnp.float32),
    ],
)
@pytest.mark.parametrize("num_rows", [1, 300])
def test_fp8_block_matmul_lowers_for_cuda(num_in, num_out, block, scale_dtype, num_rows):
    scale_shape = (-(-num_out // block[0]), -(-num_in // block[1]))
    lowered = lower_for_cuda(
        functools.partial(fp8_block_matmul, block=block),
        SDS((num_rows, num_in), jnp.bfloat16),
        SDS((num_out, num_in), jnp.float8_e4m3fn),
        SDS(scale_shape, scale_dtype),
    )
    assert num_triton_calls(lowered) == 1


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled Triton kernel)"
)
@pytest.mark.parametrize("num_rows", [1, 16, 300])
def test_kernels_compiled_on_gpu_match_reference(num_rows):
    args = _int_case(8, num_rows, 1000, 2048, 4, 128, False, jnp.bfloat16)
    out = jax.jit(functools.partial(int_matmul, bits=4, group_size=128))(*args)
    ref = int_matmul_reference(*args, bits=4, group_size=128)
    _assert_close(out, ref, _abs_bound(args[0], _int_dense(*args[1:], 4, jnp.bfloat16)))

    x, values, scale = _fp8_case(9, num_rows, 1000, 2000, (128, 128), jnp.float32)
    out = jax.jit(functools.partial(fp8_block_matmul, block=(128, 128)))(x, values, scale)
    ref = fp8_block_matmul_reference(x, values, scale, block=(128, 128))
    w = dequantize_blocks(values, scale, (128, 128)).astype(x.dtype)
    _assert_close(out, ref, _abs_bound(x, w))
