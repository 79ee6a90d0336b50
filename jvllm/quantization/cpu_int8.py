"""Rows of a bfloat16 model times int8 weight values on CPU as a native kernel (cpu_int8.cc)
through the XLA FFI.

XLA:CPU converts an int8 weight to bfloat16 in a fusion of its own before its matmul: on
SmolLM2's shapes at 64 rows that made int8 weights 1.1-2.5x slower than bfloat16 ones, and one
row 2x slower (BENCHMARKS.md, "Quantized weights"). The kernel converts each panel of weight
rows once, where the cache keeps it, reads a scanned layer's values where they lie, and scales
its sums; up to 128 rows (decode steps). Past that XLA's matmul is the faster, and the
kernel's loop converts the layer's values times their scales to bfloat16 for it: scaling the
matmul's float32 result took a pass of its own over it, which made int8 prefills 1.3x slower
than bfloat16 ones.

It is built on first use (jvllm/native/) for the CPU it runs on: AVX-512 BF16's dot products
of converted panels, elsewhere (AVX2, NEON) the values widened to float32 in registers. A
machine without a compiler, or JVLLM_CPU_INT8_KERNEL=0, keeps the pure-JAX path, which computes
the same products (past 128 rows, but for the kernel's rounding of values times scales to
bfloat16).
"""

import functools

import jax
import jax.numpy as jnp

from jvllm import native
from jvllm.quantization.dot import dot_rows

_KERNEL = "cpu_int8"  # native.SOURCES' key of jvllm/native/cpu_int8.cc
_WHAT = "CPU int8 matmul"
_TARGETS = ("Int8DenseBF16", "Int8ToBF16")
# cpu_int8.cc's kMaxRows: past it (a prefill), XLA's matmul of the values converted once is the
# faster (SmolLM2's [3072, 576] at 256 rows: 3.6 against 2.6 ms).
MAX_ROWS = 128


def supports(values: jax.Array, dtype: str) -> bool:
    """Whether rows of model dtype `dtype` times int8 `values` [..., O, I] can run the kernel
    here."""
    return (
        values.dtype == jnp.int8
        and dtype == "bfloat16"
        and values.shape[-1] % 32 == 0
        and values.shape[-2] % 4 == 0
        and _is_on()
        and _register()
    )


def dense(x: jax.Array, values: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
    """x bf16[R, I] @ (values[layer] * scale[layer]).T -> f32[R, O], values s8[L, O, I], scale
    f32[L, O]: up to MAX_ROWS rows in the kernel (float32 sums of the exact values, scaled),
    more in XLA's matmul of values * scale converted to bfloat16 by the kernel's loop. Only where
    `supports(values, "bfloat16")`."""
    if not _register():
        raise RuntimeError("the CPU int8 kernel could not be built (see the log)")
    layer = jnp.asarray(layer, jnp.int32)
    num_out, num_in = values.shape[1:]
    if x.shape[0] <= MAX_ROWS:
        result = jax.ShapeDtypeStruct((x.shape[0], num_out), jnp.float32)
        return jax.ffi.ffi_call(_TARGETS[0], result)(x, layer, values, scale)
    result = jax.ShapeDtypeStruct((num_out, num_in), jnp.bfloat16)
    return dot_rows(x, jax.ffi.ffi_call(_TARGETS[1], result)(layer, values, scale))


def build_early(dtype: str) -> None:
    """Start building the kernel for an int8 model of `dtype` that will use it, so that tracing
    the first step finds it built rather than waiting seconds for the compiler."""
    if dtype == "bfloat16" and _is_on():
        native.build_in_background(_KERNEL, _WHAT, [])


def _is_on() -> bool:
    return jax.default_backend() == "cpu" and not native.is_switched_off(
        "JVLLM_CPU_INT8_KERNEL", _WHAT
    )


@functools.cache
def _register() -> bool:
    return native.register_targets(_KERNEL, _TARGETS, _WHAT, [])
