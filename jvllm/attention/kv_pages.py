"""Reading and writing a paged KV cache [L, V, K, P, B, ...] a page row at a time: both
attention backends write a step's k, v through `write_kv`; the reference backend's page walk
gathers pages through `gather_pages`.

V, the cache's planes, is 2 (keys, values) or 1: MLA's latent cache (layers/mla.py), whose one
row per token is its key and holds its value, so that the value plane reads the key plane."""

import math

import jax
import jax.numpy as jnp

from jvllm.attention.kv_quant import (
    KVCache,
    QuantizedKVCache,
    from_storage,
    kv_values,
    quantize,
    stored_dtype,
    to_storage,
)


def _page_rows(cache: jax.Array, layer: jax.Array, kv: int, pages: jax.Array) -> jax.Array:
    """Row ids [*pages.shape, K] of `pages` (K or V by `kv`) in the [L*V*K*P, B*...] view of a
    cache [L, V, K, P, B, ...] (the values [..., H], or a quantized cache's scales); a one-plane
    cache's V is its K.

    Taking whole rows of that view moves a contiguous page per head: several times faster on
    CPU than advanced indexing of the 6-D array.
    """
    _, num_planes, num_kv_heads, num_pages = cache.shape[:4]
    plane = min(kv, num_planes - 1)
    heads = jnp.arange(num_kv_heads)
    return ((layer * num_planes + plane) * num_kv_heads + heads) * num_pages + pages[..., None]


def _scatter(
    cache: jax.Array, layer: jax.Array, kv: int, pages: jax.Array, offsets: jax.Array, new
) -> jax.Array:
    """cache [L, V, K, P, B, ...] with K (kv=0) or V (kv=1) of `layer` at the slots of pages,
    offsets i32[T] set to new [T, K, ...]."""
    block_size = cache.shape[4]
    rows = _page_rows(cache, layer, kv, pages) * block_size + offsets[:, None]  # [T, K]
    flat = cache.reshape(-1, *cache.shape[5:])  # [L*V*K*P*B, ...]
    return flat.at[rows].set(to_storage(new, cache.dtype)).reshape(cache.shape)


def write_kv(
    kv_cache: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Scatter this step's k, v [T, K, H] into kv_cache[L, V, K, P, B, H] at their slots; a
    quantized cache takes them at one byte a value with a scale per (token, KV head). A
    one-plane cache takes k only: its callers pass v = k."""
    shape = kv_values(kv_cache).shape  # [L, V, K, P, B, H]
    num_planes, block_size = shape[1], shape[4]
    pages, offsets = slot_mapping // block_size, slot_mapping % block_size  # [T]
    for kv, new in ((0, k), (1, v))[:num_planes]:
        if isinstance(kv_cache, QuantizedKVCache):
            values, scales = quantize(new, stored_dtype(kv_cache.values.dtype))  # [T, K, H], [T, K]
            kv_cache = QuantizedKVCache(
                _scatter(kv_cache.values, layer, kv, pages, offsets, values),
                _scatter(kv_cache.scales, layer, kv, pages, offsets, scales),
            )
        else:
            kv_cache = _scatter(kv_cache, layer, kv, pages, offsets, new)
    return kv_cache


def gather_pages(cache: jax.Array, layer: jax.Array, kv: int, pages: jax.Array, dtype):
    """K (kv=0) or V (kv=1) of `pages` i32[NT, C] at `layer` of a cache [L, V, K, P, B, ...]
    -> dtype[NT, K, C*B, ...]."""
    num_kv_heads, block_size = cache.shape[2], cache.shape[4]
    num_tiles, chunk = pages.shape
    flat = cache.reshape(-1, math.prod(cache.shape[4:]))  # [L*V*K*P, B*...]
    rows = _page_rows(cache, layer, kv, pages).transpose(0, 2, 1)  # [NT, K, C]
    out = from_storage(jnp.take(flat, rows, axis=0), dtype)  # [NT, K, C, B*...]
    return out.reshape(num_tiles, num_kv_heads, chunk * block_size, *cache.shape[5:])
