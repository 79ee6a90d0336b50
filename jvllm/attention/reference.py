"""Pure-JAX paged attention over the block tables: the engine's portable backend.

Queries arrive flat ([T, N, H]) and are regrouped into tiles of one sequence each ([NT, Q]); a loop
walks the pages of every tile's sequence a chunk at a time with an online softmax, so memory stays
O(tile x chunk) however long the context, and the loop runs only as far as the longest sequence.
"""

import jax
import jax.numpy as jnp

from jvllm.attention.metadata import AttentionMetadata

_MASKED = -1e30
# KV positions gathered per loop iteration. Decode tiles hold one query, so a long chunk is cheap
# and most decode steps finish in one iteration; 16-query tiles use shorter chunks. Measured on
# SmolLM2 decode at batch 64, 256 positions is 12% faster than 64.
_DECODE_CHUNK_POSITIONS = 256
_CHUNK_POSITIONS = 64
# Tiles attended together in one pass of the page loop.
_TILE_BLOCK = 32


def pages_per_chunk(block_size: int, tile_q: int = 1) -> int:
    """Pages gathered per loop iteration for tiles of `tile_q` queries."""
    positions = _DECODE_CHUNK_POSITIONS if tile_q == 1 else _CHUNK_POSITIONS
    return max(1, positions // block_size)


def _to_storage(x: jax.Array, storage_dtype) -> jax.Array:
    """Values as the cache stores them; a uint16 cache holds bfloat16 bits (see kv_cache_dtype)."""
    if storage_dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage_dtype)


def _from_storage(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


def _page_rows(kv_cache: jax.Array, layer: jax.Array, kv: int, pages: jax.Array) -> jax.Array:
    """Row ids [*pages.shape, K] of `pages` (K or V by `kv`) in the [L*2*K*P, B*H] view.

    Taking whole rows of that view moves a contiguous page per head: several times faster on
    CPU than advanced indexing of the 6-D array.
    """
    _, _, num_kv_heads, num_pages, _, _ = kv_cache.shape
    heads = jnp.arange(num_kv_heads)
    return ((layer * 2 + kv) * num_kv_heads + heads) * num_pages + pages[..., None]


def write_kv(
    kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Scatter this step's k, v [T, K, H] into kv_cache[L, 2, K, P, B, H] at their slots."""
    shape, block_size, head_dim = kv_cache.shape, kv_cache.shape[4], kv_cache.shape[5]
    pages, offsets = slot_mapping // block_size, slot_mapping % block_size  # [T]
    flat = kv_cache.reshape(-1, head_dim)  # [L*2*K*P*B, H]
    for kv, new in ((0, k), (1, v)):
        rows = _page_rows(kv_cache, layer, kv, pages) * block_size + offsets[:, None]  # [T, K]
        flat = flat.at[rows].set(_to_storage(new, kv_cache.dtype))
    return flat.reshape(shape)


def _gather_pages(kv_cache: jax.Array, layer: jax.Array, kv: int, pages: jax.Array) -> jax.Array:
    """K (kv=0) or V (kv=1) of `pages` i32[NT, C] at `layer` -> f32[NT, K, C*B, H]."""
    _, _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_tiles, chunk = pages.shape
    flat = kv_cache.reshape(-1, block_size * head_dim)  # [L*2*K*P, B*H]
    rows = _page_rows(kv_cache, layer, kv, pages).transpose(0, 2, 1)  # [NT, K, C]
    out = _from_storage(jnp.take(flat, rows, axis=0))  # [NT, K, C, B*H]
    return out.reshape(num_tiles, num_kv_heads, chunk * block_size, head_dim)


def _attend_tiles(
    qt: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    chunk: int,
) -> jax.Array:
    """Online-softmax attention of tiles qt [TB, Q, K, G, H] (pre-scaled) to their pages
    tables [TB, M], walking only as many chunks as the tiles' furthest query needs."""
    num_tiles, tile_q, num_kv_heads, group, head_dim = qt.shape
    block_size = kv_cache.shape[4]
    num_chunks = (jnp.max(positions) // block_size + chunk) // chunk  # 0 when all are padding

    def body(j, carry):
        m, l, acc = carry  # [TB, K, G, Q], [TB, K, G, Q], [TB, K, G, Q, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, j * chunk, chunk, axis=1)  # [TB, C]
        k = _gather_pages(kv_cache, layer, 0, pages)  # [TB, K, C*B, H]
        s = jnp.einsum("tqkgh,tkch->tkgqc", qt, k)  # [TB, K, G, Q, C*B]
        kv_pos = j * chunk * block_size + jnp.arange(chunk * block_size)
        visible = kv_pos[None, None, :] <= positions[:, :, None]  # [TB, Q, C*B]
        s = jnp.where(visible[:, None, None], s, _MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "tkgqc,tkch->tkgqh", p, _gather_pages(kv_cache, layer, 1, pages)
        )
        return m_new, l, acc

    shape = (num_tiles, num_kv_heads, group, tile_q)
    init = (jnp.full(shape, _MASKED), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]  # [TB, K, G, Q, H]


def paged_attention(
    q: jax.Array, kv_cache: jax.Array, layer: jax.Array, md: AttentionMetadata, sm_scale: float
) -> jax.Array:
    """Causal attention of q [T, N, H] to the paged KV of each query's sequence -> [T, N, H].

    Tiles are processed a block of `_TILE_BLOCK` at a time, and only the blocks that hold real
    tiles (the host packs them first): a bucket's padding tiles cost nothing, and each block
    reads only as far as its own furthest query.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    num_tiles, tile_q = md.tile_token_idx.shape
    chunk = pages_per_chunk(block_size, tile_q)
    tile_block = min(num_tiles, _TILE_BLOCK)
    num_blocks = -(-num_tiles // tile_block)
    pad = num_blocks * tile_block - num_tiles

    qt = q[md.tile_token_idx].reshape(num_tiles, tile_q, num_kv_heads, group, head_dim)
    qt = jnp.pad(qt.astype(jnp.float32) * sm_scale, ((0, pad),) + ((0, 0),) * 4)
    tables = jnp.pad(md.block_tables[md.tile_seq], ((0, pad), (0, 0)))  # [NT', M]
    positions = jnp.pad(md.tile_positions, ((0, pad), (0, 0)), constant_values=-1)  # [NT', Q]
    num_used = jnp.sum(positions[:, 0] >= 0)
    out = jnp.zeros((num_blocks * tile_block, num_kv_heads, group, tile_q, head_dim))

    def attend_block(b, out):
        start = b * tile_block
        part = lambda a: jax.lax.dynamic_slice_in_dim(a, start, tile_block, axis=0)
        result = _attend_tiles(part(qt), part(tables), part(positions), kv_cache, layer, chunk)
        return jax.lax.dynamic_update_slice_in_dim(out, result, start, axis=0)

    out = jax.lax.fori_loop(0, (num_used + tile_block - 1) // tile_block, attend_block, out)
    out = out[:num_tiles].transpose(0, 3, 1, 2, 4).reshape(num_tiles * tile_q, num_heads, head_dim)
    # Back to flat token order; padding slots of the tiles all point at token 0, so scatter
    # only the real ones (position >= 0) and drop the rest out of range.
    is_real = (md.tile_positions >= 0).reshape(-1)
    dest = jnp.where(is_real, md.tile_token_idx.reshape(-1), num_tokens)
    flat = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return flat.at[dest].set(out.astype(q.dtype), mode="drop")


def reference_attention(sm_scale: float):
    """The `attn` callable of the model contract (docs/design.md) for this backend."""

    def attn(layer, q, k, v, kv_cache, md: AttentionMetadata):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        return paged_attention(q, kv_cache, layer, md, sm_scale), kv_cache

    return attn
