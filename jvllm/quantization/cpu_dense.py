"""Rows times a bfloat16 or float32 weight on CPU as a native kernel (cpu_dense.cc) through the
XLA FFI: the layers' matmuls of decode steps.

XLA:CPU's matmul of a row or two reads a weight well below the bandwidth a sum over it reaches,
and inside the layer scan XLA first copies each layer's weights out of the stack: SmolLM2's
batch-1 decode moved its weights three times, slowly. The kernel reads a layer where it lies:
up to STREAM_ROWS rows it streams the weight in order (BENCHMARKS.md, "The CPU bfloat16
kernel" and "The CPU dense kernel in float32"); past it, it multiplies tiles of the weight with
the rows, which beats XLA's copy and matmul up to MAX_ROWS rows ("The CPU dense kernel past 8
rows"). A weight of its own (the LM head) goes to the kernel only up to STREAM_ROWS rows:
with nothing to copy, XLA's matmul of more rows is the faster.

It is built on first use (jvllm/native/) for the CPU it runs on (AVX-512 with or without BF16,
AVX2, NEON: one source over the portable SIMD layer); a machine without a compiler, or
JVLLM_CPU_DENSE_KERNEL=0, keeps XLA's matmul (dot.py).
"""

import functools

import jax
import jax.numpy as jnp

from jvllm import native

_KERNEL = "cpu_dense"  # native.SOURCES' key of jvllm/native/cpu_dense.cc
_WHAT = "CPU dense matmul"
STREAM_ROWS = 8  # cpu_dense.cc's kStreamRows
MAX_ROWS = 64  # cpu_dense.cc's kMaxRows: past it XLA's copy and matmul were as fast on the EPYC
IN_MULTIPLE = 32  # cpu_dense.cc's kMultiple: the weight's inputs I are a multiple of it
# A weight dtype -> its kernel.
_KERNELS = {jnp.dtype(jnp.bfloat16): "BF16DenseStacked", jnp.dtype(jnp.float32): "F32DenseStacked"}


def supports(dtype, num_in: int, num_rows: int, in_place: bool = False) -> bool:
    """Whether `num_rows` rows times a weight of `dtype` with `num_in` inputs run the kernel here;
    `in_place`: the weight is a layer of a stack, which XLA's matmul would copy out first."""
    return (
        jnp.dtype(dtype) in _KERNELS
        and num_in % IN_MULTIPLE == 0
        and num_rows <= (MAX_ROWS if in_place else STREAM_ROWS)
        and _is_on()
        and _register(jnp.dtype(dtype).name)
    )


def dense(x: jax.Array, weights: jax.Array, layer: jax.Array | int) -> jax.Array:
    """x [R, I] @ weights[layer].T -> f32[R, O], weights [L, O, I] of x's dtype (bfloat16 or
    float32), 1 <= R <= MAX_ROWS; only where `supports`. A row's products are the same in any
    batch."""
    if not _register(weights.dtype.name):
        raise RuntimeError("the CPU dense kernel could not be built (see the log)")
    result = jax.ShapeDtypeStruct((x.shape[0], weights.shape[1]), jnp.float32)
    target = _KERNELS[weights.dtype]
    return jax.ffi.ffi_call(target, result)(x, jnp.asarray(layer, jnp.int32), weights)


def build_early(dtype: str) -> None:
    """Start building the kernel for a model of `dtype` that will use it, so that tracing the
    first step finds it built rather than waiting seconds for the compiler."""
    if jnp.dtype(dtype) in _KERNELS and _is_on():
        native.build_in_background(_KERNEL, _WHAT, native.dtype_flags(dtype))


def _is_on() -> bool:
    return jax.default_backend() == "cpu" and not native.is_switched_off(
        "JVLLM_CPU_DENSE_KERNEL", _WHAT
    )


@functools.cache
def _register(dtype: str) -> bool:
    """The kernel of weights of `dtype` (a name: "float32", "bfloat16"), built for it alone."""
    target = _KERNELS[jnp.dtype(dtype)]
    return native.register_targets(_KERNEL, (target,), _WHAT, native.dtype_flags(dtype))
