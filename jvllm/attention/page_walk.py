"""The page walk of the reference backend: queries regrouped into tiles of one sequence each
([NT, Q]) attend to their sequence's pages a chunk at a time with an online softmax, so memory
stays O(tile x chunk) however long the context, and the loop runs only as far as the longest
context (with a sliding window, over the chunks the window reaches)."""

import jax
import jax.numpy as jnp

from jvllm.attention.kv_pages import gather_pages
from jvllm.attention.kv_quant import KVCache, QuantizedKVCache, kv_values
from jvllm.attention.matmul import batched_matmul
from jvllm.attention.metadata import Tiles
from jvllm.attention.window import MASKED, soft_cap

# KV positions gathered per loop iteration. Decode tiles hold one query, so a long chunk is cheap
# and most decode steps finish in one iteration; 16-query tiles use shorter chunks. Measured on
# SmolLM2 decode at batch 64, 256 positions is 12% faster than 64.
_DECODE_CHUNK_POSITIONS = 256
_CHUNK_POSITIONS = 64


def pages_per_chunk(block_size: int, tile_q: int = 1) -> int:
    """Pages gathered per loop iteration for tiles of `tile_q` queries."""
    positions = _DECODE_CHUNK_POSITIONS if tile_q == 1 else _CHUNK_POSITIONS
    return max(1, positions // block_size)


def _attend_tiles(
    qt: jax.Array,
    tables: jax.Array,
    kv_lens: jax.Array,
    kv_cache: KVCache,
    layer: jax.Array,
    chunk: int,
    model_dtype: jnp.dtype,
    kv_from: jax.Array | None = None,
    logit_softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax attention of tiles qt [TB, Q, K, G, H] (pre-scaled) to the first
    kv_lens i32[TB, Q] positions of their pages tables [TB, M], walking only as many chunks as
    the longest needs -> unnormalised (max, sum [TB, K, G, Q], weighted values [TB, K, G, Q, H]).
    With a sliding window, kv_from i32[TB, Q] is each query's first visible position."""
    num_tiles, tile_q, num_kv_heads, group, head_dim = qt.shape
    is_quantized = isinstance(kv_cache, QuantizedKVCache)
    values = kv_values(kv_cache)  # [L, V, K, P, B, H]
    is_latent = values.shape[1] == 1  # the rows are both keys and values (kv_pages.py)
    block_size = values.shape[4]
    # Multi-query tiles of a bfloat16 model multiply in bfloat16 with float32 accumulation, as
    # the window does (steps with long prompts 7% faster); one-query tiles stay float32, where
    # XLA:CPU's bfloat16 matmuls of 3 rows ran the decode step 119 -> 157 ms. A quantized
    # cache's 1-byte values are exact in either; their scales multiply the float32 scores and
    # probabilities, not the values.
    dtype = model_dtype if tile_q > 1 else jnp.float32
    shape = (num_tiles, num_kv_heads, group, tile_q)
    qt = qt.astype(dtype)
    num_steps, chunk_at = _page_walk(tables, kv_lens, kv_from, chunk, block_size)

    def scales(kv: int, pages: jax.Array) -> jax.Array:  # [TB, K, 1, 1, C*B]
        return gather_pages(kv_cache.scales, layer, kv, pages, jnp.float32)[:, :, None, None]

    def body(j, carry):
        m, l, acc = carry  # [TB, K, G, Q], [TB, K, G, Q], [TB, K, G, Q, H]
        pages, kv_pos = chunk_at(j)  # [TB, C], [TB or 1, 1, C*B]
        k = gather_pages(values, layer, 0, pages, dtype)  # [TB, K, C*B, H]
        s = _tile_scores(qt, k)  # [TB, K, G, Q, C*B]
        if is_quantized:
            k_scales = scales(0, pages)
            s = s * k_scales
        if logit_softcap is not None:
            s = soft_cap(s, logit_softcap)
        visible = kv_pos < kv_lens[:, :, None]  # [TB, Q, C*B]
        if kv_from is not None:
            visible &= kv_pos >= kv_from[:, :, None]
        s = jnp.where(visible[:, None, None], s, MASKED)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        # A latent row is its own value: its keys and their scales serve again.
        v = k if is_latent else gather_pages(values, layer, 1, pages, dtype)  # [TB, K, C*B, H]
        if is_quantized:
            p = p * (k_scales if is_latent else scales(1, pages))
        acc = acc * correction[..., None] + _tile_values(p.astype(dtype), v)
        return m_new, l, acc

    init = (jnp.full(shape, MASKED), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
    return jax.lax.fori_loop(0, num_steps, body, init)


def _page_walk(
    tables: jax.Array, kv_lens: jax.Array, kv_from: jax.Array | None, chunk: int, block_size: int
):
    """The page loop's schedule for tiles reading kv_lens i32[TB, Q] positions of their pages
    tables [TB, M] -> (number of steps, step j -> (pages i32[TB, C], positions [TB or 1, 1, C*B])).

    Without a window every tile reads chunk j at step j, as far as the longest read needs. With
    one (kv_from, each query's first visible position) each tile starts at the chunk of its
    earliest query's first key, so a long context costs the window, not its length; a tile that
    ends before the others reads past its end (clipped to its last pages), all masked.
    """
    span = chunk * block_size
    if kv_from is None:

        def same_chunk(j):
            pages = jax.lax.dynamic_slice_in_dim(tables, j * chunk, chunk, axis=1)
            kv_pos = j * chunk * block_size + jnp.arange(chunk * block_size)
            return pages, kv_pos[None, None, :]

        return (jnp.max(kv_lens) + chunk * block_size - 1) // (chunk * block_size), same_chunk

    reads = kv_lens > 0  # [TB, Q]
    earliest = jnp.min(jnp.where(reads, kv_from, jnp.iinfo(jnp.int32).max), axis=1)  # [TB]
    first = jnp.where(reads.any(axis=1), jnp.maximum(earliest, 0) // span, 0)  # [TB]
    end = (jnp.max(kv_lens, axis=1) + span - 1) // span  # [TB]

    def own_chunk(j):
        c = first + j  # [TB]
        cols = c[:, None] * chunk + jnp.arange(chunk)  # [TB, C]
        pages = jnp.take_along_axis(tables, cols, axis=1, mode="clip")
        return pages, (c[:, None] * span + jnp.arange(span))[:, None, :]

    return jnp.max(end - first), own_chunk


def _tile_scores(qt: jax.Array, k: jax.Array) -> jax.Array:
    """qt [TB, Q, K, G, H] . k [TB, K, C, H] -> float32 [TB, K, G, Q, C].

    bfloat16 goes through batched_matmul (see there); float32 stays an einsum, which XLA:CPU
    runs faster for the one-query decode tiles (decode attention of 64 sequences, 30 layers:
    100 ms against 130 ms as batched_matmul).
    """
    if qt.dtype != jnp.bfloat16:
        return jnp.einsum("tqkgh,tkch->tkgqc", qt, k, preferred_element_type=jnp.float32)
    num_tiles, tile_q, num_kv_heads, group, head_dim = qt.shape
    rows = qt.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, -1, head_dim)
    s = batched_matmul(rows, k, y_transposed=True)  # [TB, K, G*Q, C]
    return s.reshape(num_tiles, num_kv_heads, group, tile_q, -1)


def _tile_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """p [TB, K, G, Q, C] @ v [TB, K, C, H] -> float32 [TB, K, G, Q, H], as _tile_scores."""
    if p.dtype != jnp.bfloat16:
        return jnp.einsum("tkgqc,tkch->tkgqh", p, v, preferred_element_type=jnp.float32)
    rows = p.reshape(*p.shape[:2], -1, p.shape[-1])  # [TB, K, G*Q, C]
    return batched_matmul(rows, v).reshape(*p.shape[:-1], v.shape[-1])


def _to_rows(x: jax.Array) -> jax.Array:
    """Per-tile results [TB, K, G, Q, ...] -> per-query rows [TB*Q, K*G, ...]."""
    num_tiles, num_kv_heads, group, tile_q = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(num_tiles * tile_q, num_kv_heads * group, *x.shape[4:])


def attend_pages(
    q: jax.Array,
    kv_cache: KVCache,
    layer: jax.Array,
    tiles: Tiles,
    tables: jax.Array,
    flat: tuple[jax.Array, ...],
    tile_block: int,
    finish=None,
    *,
    model_dtype: jnp.dtype,
    first_visible: jax.Array | None = None,
    logit_softcap: float | None = None,
) -> tuple[jax.Array, ...]:
    """Attend `tiles` of q [T, N, H] (pre-scaled f32, from a model of `model_dtype`) to the
    first kv_lens positions of their sequence's pages `tables` [S, M], and write each query's
    unnormalised (max, sum [N], weighted values [N, H]), or what `finish` makes of them, over its
    token's row of `flat`. With a sliding window, first_visible i32[T] is each token's first
    visible position.

    Tiles are processed `tile_block` at a time, and only the blocks that hold tiles
    reading pages (the host packs them first): work and memory follow the tiles in use, not the
    bucket's capacity, and each block reads only as far as its own longest context.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, _, block_size, _ = kv_values(kv_cache).shape
    group = num_heads // num_kv_heads
    num_tiles, tile_q = tiles.token_idx.shape
    chunk = pages_per_chunk(block_size, tile_q)
    tile_block = min(num_tiles, tile_block)
    pad = ((0, -num_tiles % tile_block), (0, 0))
    token_idx = jnp.pad(tiles.token_idx, pad)  # [NT', Q]
    kv_lens = jnp.pad(tiles.kv_lens, pad)  # [NT', Q]; padding tiles read nothing
    seq = jnp.pad(tiles.seq, pad[:1])  # [NT']
    finish = finish or (lambda *result: result)

    def attend_block(b, flat):
        part = lambda a: jax.lax.dynamic_slice_in_dim(a, b * tile_block, tile_block, axis=0)
        idx, lens = part(token_idx), part(kv_lens)  # [TB, Q]
        qt = q[idx].reshape(tile_block, tile_q, num_kv_heads, group, head_dim)
        kv_from = None if first_visible is None else first_visible[idx]  # [TB, Q]
        result = finish(
            *_attend_tiles(
                qt,
                tables[part(seq)],
                lens,
                kv_cache,
                layer,
                chunk,
                model_dtype,
                kv_from,
                logit_softcap,
            )
        )
        # Slots that read nothing (padding) go out of range and are dropped.
        dest = jnp.where(lens > 0, idx, num_tokens).reshape(-1)  # [TB*Q]
        return tuple(f.at[dest].set(_to_rows(r), mode="drop") for f, r in zip(flat, result))

    num_used = jnp.sum(tiles.kv_lens[:, 0] > 0)
    return jax.lax.fori_loop(0, (num_used + tile_block - 1) // tile_block, attend_block, flat)
