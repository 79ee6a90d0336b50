"""Attention of one-query tiles on CPU as a native kernel (cpu_decode.cc) through the XLA FFI.

XLA:CPU runs the reference backend's decode attention as many small batched products, well
below what reading the KV takes (a SmolLM2 batch-64 step: 66 of 111 ms; BENCHMARKS.md). The
kernel reads each KV head's rows once for its query heads, in float32 from a bfloat16 or
float32 cache, on XLA's intra-op threads, for decode steps and for the decodes of steps with
prefills.

It is built on first use (jvllm/native/); a machine without a compiler, or
JVLLM_CPU_DECODE_KERNEL=0, keeps the pure-JAX path, which computes the same attention.
"""

import functools

import jax
import jax.numpy as jnp

from jvllm import native
from jvllm.attention.metadata import Tiles

_KERNEL = "cpu_decode"  # native.SOURCES' key of jvllm/native/cpu_decode.cc
_WHAT, _FLAGS = "CPU decode attention", ["-ffast-math"]
# The cache's storage dtype -> (its kernel, the model dtype it is built for): kv_quant.py keeps
# bfloat16 as uint16 bits on CPU.
_TARGETS = {
    jnp.dtype(jnp.uint16): ("DecodeAttentionBF16", "bfloat16"),
    jnp.dtype(jnp.float32): ("DecodeAttentionF32", "float32"),
}


def supports(cache: jax.Array) -> bool:
    """Whether decode attention over `cache` [L, V, K, P, B, H] can run the kernel here."""
    return (
        cache.dtype in _TARGETS
        and jax.default_backend() == "cpu"
        and not native.is_switched_off("JVLLM_CPU_DECODE_KERNEL", _WHAT)
        and _register(cache.dtype)
    )


def attend_pages(
    q: jax.Array,
    cache: jax.Array,
    layer: jax.Array,
    tables: jax.Array,
    tiles: Tiles,
    flat: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-query tiles of q f32[T, N, H] (pre-scaled) to the first kv_lens positions of their
    sequence's pages in cache [L, V, K, P, B, H] at `layer` (V = 1: the values are the keys'
    rows, MLA's latent): `flat`, the unnormalised (max
    f32[T, N], sum f32[T, N], weighted values f32[T, N, H]), with the rows of the tokens the
    tiles read written over, as reference.py's page walk does. Only where `supports(cache)`."""
    if not _register(cache.dtype):
        raise RuntimeError("the CPU decode attention kernel could not be built (see the log)")
    results = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in flat)
    target = _TARGETS[cache.dtype][0]
    call = jax.ffi.ffi_call(target, results, input_output_aliases={7: 0, 8: 1, 9: 2})
    return call(
        q,
        cache,
        jnp.asarray(layer, jnp.int32),
        tables,
        tiles.token_idx[:, 0],
        tiles.seq,
        tiles.kv_lens[:, 0],
        *flat,
    )


def build_early(dtype: str) -> None:
    """Start building the kernel of a model of `dtype`'s cache where it will be used (see
    supports), so that tracing the first step finds it built rather than waiting seconds for
    the compiler."""
    if (
        dtype in (model_dtype for _, model_dtype in _TARGETS.values())
        and jax.default_backend() == "cpu"
        and not native.is_switched_off("JVLLM_CPU_DECODE_KERNEL", _WHAT)
    ):
        native.build_in_background(_KERNEL, _WHAT, _flags(dtype))


def _flags(dtype: str) -> list[str]:
    return [*_FLAGS, *native.dtype_flags(dtype)]


@functools.cache
def _register(cache_dtype) -> bool:
    """The kernel of a cache stored as `cache_dtype`, built for its model dtype alone."""
    target, dtype = _TARGETS[jnp.dtype(cache_dtype)]
    return native.register_targets(_KERNEL, (target,), _WHAT, _flags(dtype))
