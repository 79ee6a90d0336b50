"""Rows times a 4- or 8-bit grouped integer weight (int_weight.py's layout: GPTQ, AWQ,
compressed-tensors W4A16 / W8A16), or a float8 e4m3 weight with a scale per block (fp8_weight.py:
FP8 checkpoints), on CPU as a native kernel (cpu_int_group.cc) through the XLA FFI.

Dequantizing the layer in XLA for one matmul is compute-bound on unpacking and scaling, worst
for one row (batch-1 decode: 1.2-3.3 ms a SmolLM2 layer). The kernel makes each output row's
values where they lie in the stacked layer, exactly as `int_weight.dequantize(...).astype(dtype)`
makes them: a 4-bit group's 16 values become a table that each run of packed nibbles is looked
up in (one permute for 16 values with AVX-512), 8-bit and e4m3 values are made vector by
vector (an e4m3 byte's bits moved into float16's and widened exactly: simd_lanes.h's
load_e4m3). Every value is rounded as the reference rounds it, in a float32 model too: scaling
each group's sum of x times its integers instead would save no time over the lookup. Up to
MAX_ROWS rows it multiplies them into x, summing in float32 (a row's sums the same in any
batch); more rows go to XLA's matmul of the layer dequantized by the kernel's loop, the same
values bit for bit (at 32 rows the two take about as long). Batch-1 on one core of a Zen 5 EPYC, W4A16 against the
packed GGUF Q4_1 kernel on SmolLM2's shapes: 1.2-1.4x its speed in a float32 model, 1.2-1.85x
in a bfloat16 one. Built without AVX-512 (AVX2's 8-lane permutes take two and a blend to look
up 16 values): 0.6-0.65x in a float32 model, where Q4_1's kernel scales each block's sum of x
times its integers (W4A16's values, each rounded to float16 or bfloat16, cannot be factored so
within float32's tolerance), and 1.6-2x in a bfloat16 one. `benchmark()` in
tests/test_cpu_int_group.py measures them.

It is built on first use (jvllm/native/); a machine without a compiler, or
JVLLM_CPU_INT_GROUP_KERNEL=0, keeps the caller's pure-JAX path.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jvllm import native
from jvllm.quantization.dot import dot_rows

_KERNEL = "cpu_int_group"  # native.SOURCES' key of jvllm/native/cpu_int_group.cc
_WHAT = "CPU grouped-integer matmul"
_TARGETS = ("IntGroupDense", "IntGroupDequantize")
# cpu_int_group.cc's kMaxRows: at 32 rows its products and XLA's matmul of the layer it
# dequantizes take about as long (SmolLM2's shapes on the EPYC).
MAX_ROWS = 32
_DTYPES = ("float32", "bfloat16")
_SCALE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_BITS = (4, 8)
_GROUP_MULTIPLE = 32  # the kernel reads a row in runs of 32 columns, each in one group
# No contraction of a product and a sum into one rounding: the values must be
# int_weight.dequantize's bit for bit.
_FLAGS = ["-ffp-contract=off"]


def supports(dtype: str, bits: int, group_size: int, scale_dtype) -> bool:
    """Whether rows of model dtype `dtype` times a weight of `bits` with groups of `group_size`
    columns and scales of `scale_dtype` can go through the kernel here."""
    return (
        dtype in _DTYPES
        and bits in _BITS
        and group_size > 0
        and group_size % _GROUP_MULTIPLE == 0
        and jnp.dtype(scale_dtype) in _SCALE_DTYPES
        and _is_on()
        and _register()
    )


def dense(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None,
    layer: jax.Array,
    bits: int,
    group_size: int,
    dtype: str,
    block_rows: int = 1,
) -> jax.Array:
    """x [R, I] (model dtype or f32) @ W.T -> f32[R, O], W [O, I] layer i32[] `layer` of packed
    u8[L, O, I * bits / 8] (or float8_e4m3fn[L, O, I], bits 8), scale [L, ceil(O / block_rows),
    ceil(I / group_size)] and zero (None or i16[L, O, I / group_size]; None for float8), in
    model dtype `dtype` (x is cast to it, as dot_rows casts it); I a multiple of 32, and of
    group_size but for float8, whose last block of a row may be short (past the weight's edge).
    Up to MAX_ROWS rows in the kernel, more in XLA's matmul of W dequantized by the kernel's
    loop. Only where `supports(dtype, bits, group_size, scale.dtype)`."""
    if not _register():
        raise RuntimeError("the CPU grouped-integer kernel could not be built (see the log)")
    num_layers, num_out, num_bytes = packed.shape
    num_in = num_bytes * 8 // bits
    if x.ndim != 2 or x.shape[1] != num_in:
        raise ValueError(f"x must be [R, {num_in}] for a weight of {num_in} inputs, got {x.shape}")
    fp8 = packed.dtype == jnp.float8_e4m3fn
    groups = (num_layers, num_out, -(-num_in // group_size))
    scales = (num_layers, -(-num_out // block_rows), groups[2])
    if num_in % _GROUP_MULTIPLE or (num_in % group_size and not fp8) or scale.shape != scales:
        raise ValueError(
            f"scale must be {scales} for blocks of {block_rows} x {group_size}, and I "
            f"({num_in}) a multiple of {_GROUP_MULTIPLE}; got {scale.shape}"
        )
    if zero is not None and (fp8 or zero.shape != groups or zero.dtype != jnp.int16):
        raise ValueError(
            f"zero must be int16 {groups} or None (float8), got {zero.dtype}{zero.shape}"
        )
    zeros = () if zero is None else (zero,)
    layer = jnp.asarray(layer, jnp.int32)
    attributes = {"block_rows": np.int64(block_rows), "group_size": np.int64(group_size)}
    if x.shape[0] <= MAX_ROWS:
        result = jax.ShapeDtypeStruct((x.shape[0], num_out), jnp.float32)
        call = jax.ffi.ffi_call(_TARGETS[0], result)
        return call(x.astype(dtype), layer, packed, scale, *zeros, **attributes)
    result = jax.ShapeDtypeStruct((num_out, num_in), dtype)
    w = jax.ffi.ffi_call(_TARGETS[1], result)(layer, packed, scale, *zeros, **attributes)
    return dot_rows(x, w)


def build_early(dtype: str) -> None:
    """Start building the kernel for a model of `dtype` whose checkpoint holds integer weights,
    so that tracing the first step finds it built rather than waiting seconds for the compiler."""
    if dtype in _DTYPES and _is_on():
        native.build_in_background(_KERNEL, _WHAT, _FLAGS)


def _is_on() -> bool:
    return jax.default_backend() == "cpu" and not native.is_switched_off(
        "JVLLM_CPU_INT_GROUP_KERNEL", _WHAT
    )


@functools.cache
def _register() -> bool:
    return native.register_targets(_KERNEL, _TARGETS, _WHAT, _FLAGS)
