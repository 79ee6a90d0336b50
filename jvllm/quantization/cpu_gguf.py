"""Rows times a packed GGUF weight on CPU as a native kernel (cpu_gguf.cc) through the XLA FFI.

XLA:CPU's fused dequantize-multiply-reduce of a Q4_1 [3072, 576] weight took 0.75-1.0 ms where
the same weight in bfloat16 took 0.33 ms (BENCHMARKS.md, "Quantized weights"): unpacking
nibbles and broadcasting block scales in XLA's generated loops is compute-bound, and more rows
dequantize the whole weight to float32 first. The kernel splits each block into integers and
scales and multiplies it into up to 32 rows (in a float32 model scaling each sub-block's
sum, in a bfloat16 one making gguf's values, rounded), reading a scanned layer's blocks where
they lie (SmolLM2's Q4_1 decoding one sequence on one core: 6.5 -> 56.6 tok/s, 1.14x
llama.cpp's speed on the same file on the Xeon, about 1.0x on the EPYC; BENCHMARKS.md).

More rows go to XLA's matmul of the layer dequantized by the kernel's loop, at memory speed
(XLA's own dequantization of a Q4_1 [3072, 576] layer took 1.5 ms, 4.4 in bfloat16, against
the 64-row matmul's 1.2). It is built on first use (jvllm/native/), once for each model dtype
(a build of one compiles half the templates), and early where the engine is to load a packed
GGUF (build_early); a machine without a compiler, or JVLLM_CPU_GGUF_KERNEL=0, keeps the pure-JAX
path, which computes the same products.
"""

import functools

import jax
import jax.numpy as jnp
from gguf.constants import GGMLQuantizationType as Q

from jvllm import native
from jvllm.quantization.dot import dot_rows
from jvllm.quantization.gguf_blocks import BLOCK_FORMATS, PACKED_QTYPES

_KERNEL = "cpu_gguf"  # native.SOURCES' key of jvllm/native/cpu_gguf.cc
_WHAT = "CPU GGUF matmul"
MAX_ROWS = 32  # cpu_gguf.cc's kMaxRows: past it, dequantizing for XLA's matmul is faster
_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _target(kind: str, qtype: int, dtype: str) -> str:
    return f"GGUF{kind}{Q(qtype).name}{_DTYPES[dtype]}"


def supports(dtype: str) -> bool:
    """Whether rows times a GGUF weight used in `dtype` can go through the kernel here."""
    return dtype in _DTYPES and _is_on() and _register(dtype)


def dense(
    x: jax.Array, fields: dict[str, jax.Array], layer: jax.Array, qtype: int, dtype: str
) -> jax.Array:
    """x f32[R, I] (values of the model dtype) @ W.T -> f32[R, O], W [O, I] at `layer` of
    `fields` (each [L, O, nb, ...]): up to MAX_ROWS rows in the kernel, more in XLA's matmul of
    W dequantized by the kernel's loop (the same values). Only where `supports(dtype)`."""
    if not _register(dtype):
        raise RuntimeError("the CPU GGUF kernel could not be built (see the log)")
    # In the format's field order: a dict that went through jit comes back with sorted keys.
    ordered = [fields[name] for name in BLOCK_FORMATS[Q(qtype)].fields.names]
    layer = jnp.asarray(layer, jnp.int32)
    num_out, num_in = ordered[0].shape[1], x.shape[1]
    if x.shape[0] <= MAX_ROWS:
        result = jax.ShapeDtypeStruct((x.shape[0], num_out), jnp.float32)
        return jax.ffi.ffi_call(_target("Dense", qtype, dtype), result)(x, layer, *ordered)
    result = jax.ShapeDtypeStruct((num_out, num_in), dtype)
    w = jax.ffi.ffi_call(_target("Dequantize", qtype, dtype), result)(layer, *ordered)
    return dot_rows(x, w)


def build_early(dtype: str) -> None:
    """Start building the kernel for a packed GGUF model of `dtype`, so that tracing the first
    step finds it built rather than waiting seconds for the compiler."""
    if dtype in _DTYPES and _is_on():
        native.build_in_background(_KERNEL, _WHAT, _flags(dtype))


def _is_on() -> bool:
    return jax.default_backend() == "cpu" and not native.is_switched_off(
        "JVLLM_CPU_GGUF_KERNEL", _WHAT
    )


def _flags(dtype: str) -> list[str]:
    # No contraction of a product and a sum into one rounding: the dequantized values must be
    # gguf's bit for bit. And only `dtype`'s handlers.
    return ["-ffp-contract=off", *native.dtype_flags(dtype)]


@functools.cache
def _register(dtype: str) -> bool:
    targets = tuple(
        _target(kind, int(q), dtype) for kind in ("Dense", "Dequantize") for q in PACKED_QTYPES
    )
    return native.register_targets(_KERNEL, targets, _WHAT, _flags(dtype))
