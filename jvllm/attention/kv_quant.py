"""The quantized KV cache (`kv_cache_dtype` "fp8" or "int8"): one byte a value, and a scale for
each (token, KV head) written beside the values when the token's K and V are.

A scale per row of H values needs no calibration data and cannot overflow: a row is divided by
its own max |x| / QMAX. (vLLM's default fp8 cache has one scale per tensor, 1.0 unless a
checkpoint brings calibrated ones, which can overflow e4m3's +-448 on models with large keys.)
The scales are bfloat16, so a token takes H + 2 bytes a KV head for K and as many for V, against
2H in a bfloat16 cache and 4H in a float32 one.

On CPU a cache of float8 or bfloat16 holds their bits (uint8, uint16): XLA:CPU converts a whole
float8 or bfloat16 array to float32 and back around every scatter into it (BENCHMARKS.md,
"Quantized KV cache"). `to_storage` and `from_storage` convert.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jvllm.quantization.rows import quantize_rows

# vLLM's names -> the dtype of the values ("auto": the model's, unquantized).
_VALUE_DTYPES = {
    "auto": None,
    "fp8": jnp.dtype(jnp.float8_e4m3fn),
    "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "int8": jnp.dtype(jnp.int8),
}
KV_CACHE_DTYPES = tuple(_VALUE_DTYPES)
SCALE_DTYPE = jnp.dtype(jnp.bfloat16)
# Floats a cache holds as bits on CPU (see the module's docstring) -> their bits' dtype.
_BITS_OF_FLOAT = {
    jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8),
    jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16),
}
_FLOAT_OF_BITS = {bits: x for x, bits in _BITS_OF_FLOAT.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVCache:
    """K and V at one byte a value: value = values * scales[..., None]."""

    values: jax.Array  # [L, V, K, P, B, H] int8 or float8_e4m3fn (uint8 bits on CPU)
    scales: jax.Array  # [L, V, K, P, B] bfloat16 (uint16 bits on CPU)


# The engine's KV cache: one array [L, V, K, P, B, H] of the model's dtype, or a quantized one
# (V: 2 planes, keys and values, or 1, MLA's latent row; kv_pages.py).
KVCache = jax.Array | QuantizedKVCache


def kv_values(kv_cache: KVCache) -> jax.Array:
    """The [L, V, K, P, B, H] array of either kind of cache (a quantized one's 1-byte values)."""
    return kv_cache.values if isinstance(kv_cache, QuantizedKVCache) else kv_cache


def quantized_dtype(kv_cache_dtype: str) -> jnp.dtype | None:
    """The values' dtype of a `kv_cache_dtype` (one of KV_CACHE_DTYPES); None for "auto"."""
    return _VALUE_DTYPES[kv_cache_dtype]


def quantize(x: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (values dtype[..., H], scales bfloat16[...]), x ~= values * scales, each row
    scaled by its max |x| (a row of zeros gets scale 0 and values 0)."""
    return quantize_rows(x, dtype, SCALE_DTYPE)


def dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., H] (1-byte, or their storage bits), scales [...] -> f32[..., H]."""
    return from_storage(values, jnp.float32) * from_storage(scales, jnp.float32)[..., None]


def bits_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """What a cache on CPU stores `dtype` as: float8 and bfloat16 as their bits, else itself."""
    return _BITS_OF_FLOAT.get(jnp.dtype(dtype), jnp.dtype(dtype))


def stored_dtype(storage_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype whose values a cache array of `storage_dtype` holds."""
    return jnp.dtype(_FLOAT_OF_BITS.get(jnp.dtype(storage_dtype), storage_dtype))


def to_storage(x: jax.Array, storage_dtype: jnp.dtype) -> jax.Array:
    """x as a cache of `storage_dtype` holds it: uint8 / uint16 hold float8 / bfloat16 bits."""
    x = x.astype(stored_dtype(storage_dtype))
    return x if x.dtype == storage_dtype else jax.lax.bitcast_convert_type(x, storage_dtype)


def from_storage(x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
    """What a cache array holds, as `dtype` (None: as the floats that it stores)."""
    float_dtype = _FLOAT_OF_BITS.get(x.dtype)
    if float_dtype is not None:
        x = jax.lax.bitcast_convert_type(x, float_dtype)
    return x if dtype is None else x.astype(dtype)
