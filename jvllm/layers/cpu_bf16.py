"""A few rows times a bfloat16 weight on CPU as a native kernel (cpu_bf16.cc) through the XLA
FFI, where the CPU has AVX-512 BF16: decode steps of up to MAX_ROWS sequences.

XLA:CPU's matmul of a row or two reads a bfloat16 weight at a third of the bandwidth a sum over
it reaches, and inside the layer scan XLA first copies each layer's weights out of the stack:
SmolLM2's bfloat16 batch-1 decode moved its weights three times, slowly. The kernel reads a
layer where it lies and streams the weight in order (BENCHMARKS.md, "The CPU bfloat16
kernel"); past MAX_ROWS rows XLA's matmul is the faster.

It is built on first use (jvllm/native.py); a CPU without AVX-512 BF16, a machine without a
compiler, or JVLLM_CPU_BF16_KERNEL=0 keeps XLA's matmul (layers/dot.py).
"""

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jvllm import native

_SOURCE = Path(__file__).with_name("cpu_bf16.cc")
_TARGET = "BF16DenseStacked"
_WHAT = "CPU bfloat16 matmul"
MAX_ROWS = 8  # cpu_bf16.cc's kMaxRows


def supports(dtype, num_in: int, num_rows: int) -> bool:
    """Whether `num_rows` rows times a weight of `dtype` with `num_in` inputs can run the kernel
    here."""
    return (
        dtype == jnp.bfloat16
        and num_in % 32 == 0
        and num_rows <= MAX_ROWS
        and _may_run()
        and _register()
    )


def dense(x: jax.Array, weights: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x bf16[R, I] @ weights[layer].T -> f32[R, O], weights bf16[L, O, I], 1 <= R <= MAX_ROWS;
    only where `supports`."""
    if not _register():
        raise RuntimeError("the CPU bfloat16 kernel could not be built (see the log)")
    result = jax.ShapeDtypeStruct((x.shape[0], weights.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, result)(x, jnp.asarray(layer, jnp.int32), weights)


def build_early(dtype: str) -> None:
    """Start building the kernel for a model of `dtype` that will use it, so that tracing the
    first step finds it built rather than waiting seconds for the compiler."""
    if dtype == "bfloat16" and _may_run():
        native.build_in_background(_SOURCE, _WHAT, [])


def _may_run() -> bool:
    return (
        jax.default_backend() == "cpu"
        and os.environ.get("JVLLM_CPU_BF16_KERNEL", "1") != "0"
        and native.cpu_has("avx512_bf16")
    )


@functools.cache
def _register() -> bool:
    return native.register_targets(_SOURCE, (_TARGET,), _WHAT, [])
