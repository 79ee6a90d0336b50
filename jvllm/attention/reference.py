"""Pure-JAX paged attention over the block tables: the engine's portable backend.

Queries arrive flat ([T, N, H]); those that read pages are regrouped into tiles of one sequence
each ([NT, Q]), and a loop walks the pages of every tile's sequence a chunk at a time with an
online softmax, so memory stays O(tile x chunk) however long the context, and the loop runs only
as far as the longest context. In steps with prefills the step's recent tokens are attended
directly from k, v (window.py), which XLA:CPU runs as dense matmuls: page gathers are what cost.
"""

import jax
import jax.numpy as jnp

from jvllm.attention import cpu_decode
from jvllm.attention.image_ahead import attend_image_ahead, blocks_ahead, merge_partials
from jvllm.attention.kv_pages import gather_pages, write_kv
from jvllm.attention.kv_quant import KVCache, QuantizedKVCache, kv_values
from jvllm.attention.matmul import batched_matmul
from jvllm.attention.metadata import AttentionMetadata, Tiles
from jvllm.attention.window import MASKED, attend_window, soft_cap, token_seq_and_position

# KV positions gathered per loop iteration. Decode tiles hold one query, so a long chunk is cheap
# and most decode steps finish in one iteration; 16-query tiles use shorter chunks. Measured on
# SmolLM2 decode at batch 64, 256 positions is 12% faster than 64.
_DECODE_CHUNK_POSITIONS = 256
_CHUNK_POSITIONS = 64
# Tiles attended together in one pass of the page loop, in decode steps and in steps with
# prefills. The latter use few tiles (a sequence's queries all read the same positions of
# earlier steps from the pages, and there are few decodes): blocks of 8 ran such a step's
# attention 1105 -> 772 ms (30 layers) where 32 gathered pages for padding tiles.
_DECODE_TILE_BLOCK = 32
_MIXED_TILE_BLOCK = 8


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


def _normalize(m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array]:
    return (acc / jnp.where(l > 0, l, 1.0)[..., None],)


def _fold_sinks(
    m: jax.Array, l: jax.Array, acc: jax.Array, sinks: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax's unnormalised (max, sum [..., N], weighted values [..., N, H]) with one
    more key per head, of logit `sinks` (broadcast against max, unscaled) and no value:
    gpt-oss's attention sinks, which take a share of each query's probability."""
    m_new = jnp.maximum(m, sinks)
    correction = jnp.exp(m - m_new)
    return m_new, l * correction + jnp.exp(sinks - m_new), acc * correction[..., None]


def _to_rows(x: jax.Array) -> jax.Array:
    """Per-tile results [TB, K, G, Q, ...] -> per-query rows [TB*Q, K*G, ...]."""
    num_tiles, num_kv_heads, group, tile_q = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(num_tiles * tile_q, num_kv_heads * group, *x.shape[4:])


def _attend_pages(
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


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: KVCache,
    layer: jax.Array,
    md: AttentionMetadata,
    sm_scale: float,
    logit_softcap: float | None = None,
    sliding_window: jax.Array | None = None,
    sinks: jax.Array | None = None,
    image_blocks_ahead: int = 0,
) -> jax.Array:
    """Causal attention of q [T, N, H] to the KV of each query's sequence -> [T, N, H].

    `kv_cache` already holds this step's k, v [T, K, H]. A decode step reads everything, its
    own key included, from the pages. A step with prefills reads the step's recent tokens from
    k, v directly (window.py) and only older positions from the pages, and skips the pages
    altogether when no query needs them (fresh prompts that fit their windows). So with a
    quantized cache a prompt attends to its own step's keys and values as the model made them,
    and to those of earlier steps as the cache holds them.

    logit_softcap: None or a static c, scores c * tanh(score / c) after scaling (Gemma 2).
    sliding_window: None or i32[] W, possibly traced: a query at p sees p - W < j <= p, and the
    page walks start at the chunk the window reaches.
    sinks: None or f32[N] (may be traced), a per-head logit joining every query's softmax with
    no value (gpt-oss), not scaled or capped; folded in where the softmax is normalised.
    image_blocks_ahead: > 0 for a model whose image tokens attend to their whole image
    (`md.image_groups`; attention/image_ahead.py), the blocks ahead they read.
    """
    if sinks is not None:
        sinks = _sinks_vector(sinks, q.shape[1])
    q_scaled = q.astype(jnp.float32) * sm_scale
    first_visible = None
    if sliding_window is not None:
        sliding_window = _window_scalar(sliding_window)
        first_visible = token_seq_and_position(md, q.shape[0])[1] - sliding_window + 1  # [T]
    pages_options = {
        "model_dtype": q.dtype,
        "first_visible": first_visible,
        "logit_softcap": logit_softcap,
    }
    # The CPU kernel reads the one-query tiles: every tile of a decode step, and the decodes
    # beside the prefills of a mixed one.
    native = (
        logit_softcap is None
        and sliding_window is None
        and not isinstance(kv_cache, QuantizedKVCache)
        and cpu_decode.supports(kv_cache)
    )

    def no_pages():
        shape = q.shape[:2]
        return jnp.full(shape, MASKED), jnp.zeros(shape), jnp.zeros(q.shape)

    if md.is_decode:
        (tiles,) = md.tiles
        if native:
            flat = cpu_decode.attend_pages(
                q_scaled, kv_cache, layer, md.block_tables, tiles, no_pages()
            )
            if sinks is not None:
                flat = _fold_sinks(*flat, sinks)
            (out,) = _normalize(*flat)
            return out.astype(q.dtype)
        init = (jnp.zeros(q.shape),)
        (out,) = _attend_pages(
            q_scaled,
            kv_cache,
            layer,
            tiles,
            md.block_tables,
            init,
            _DECODE_TILE_BLOCK,
            _normalize if sinks is None else _normalize_with_sinks(sinks, kv_cache),
            **pages_options,
        )
        return out.astype(q.dtype)

    def from_pages():
        flat = no_pages()  # each query is in one group at most: fill in the groups in turn
        for tiles in md.tiles:
            if native and tiles.token_idx.shape[1] == 1:
                flat = cpu_decode.attend_pages(
                    q_scaled, kv_cache, layer, md.block_tables, tiles, flat
                )
            else:
                flat = _attend_pages(
                    q_scaled,
                    kv_cache,
                    layer,
                    tiles,
                    md.block_tables,
                    flat,
                    _MIXED_TILE_BLOCK,
                    **pages_options,
                )
        return flat

    reads_pages = jnp.any(jnp.stack([jnp.any(tiles.kv_lens > 0) for tiles in md.tiles]))
    m1, l1, acc1 = jax.lax.cond(reads_pages, from_pages, no_pages)
    if sinks is not None:  # one more key of the pages' half, merged with the window's below
        m1, l1, acc1 = _fold_sinks(m1, l1, acc1, sinks)
    m2, l2, acc2 = attend_window(q, k, v, md, sm_scale, logit_softcap, sliding_window)
    m, l, acc = merge_partials((m1, l1, acc1), (m2, l2, acc2))
    if md.image_groups is not None and image_blocks_ahead:  # and the image's later tokens
        ahead = jax.lax.cond(
            jnp.any(md.image_groups >= 0),
            lambda: attend_image_ahead(
                q, k, v, md.image_groups, image_blocks_ahead, sm_scale, logit_softcap
            ),
            no_pages,
        )
        m, l, acc = merge_partials((m, l, acc), ahead)
    return (acc / l[..., None]).astype(q.dtype)


def _normalize_with_sinks(sinks: jax.Array, kv_cache: KVCache):
    """The page walk's `finish` for tiles [TB, K, G, Q, ...]: the sinks f32[N] (query head
    n = k * G + g) folded in, then normalised."""
    num_kv_heads = kv_values(kv_cache).shape[2]
    per_tile = sinks.reshape(num_kv_heads, -1, 1)  # [K, G, 1]
    return lambda m, l, acc: _normalize(*_fold_sinks(m, l, acc, per_tile))


def _sinks_vector(sinks, num_heads: int) -> jax.Array:
    """The sinks as f32[N], checked to hold one logit per query head (values may be traced)."""
    if jnp.shape(sinks) != (num_heads,):
        raise ValueError(
            f"sinks must be None or one logit per query head, f32[{num_heads}], got "
            f"{jnp.result_type(sinks)}{jnp.shape(sinks)}"
        )
    return jnp.asarray(sinks, jnp.float32)


def _window_scalar(sliding_window) -> jax.Array:
    """The window as i32[], checked to be an integer scalar (its value may be traced)."""
    if jnp.shape(sliding_window) not in ((), (1,)) or not jnp.issubdtype(
        jnp.result_type(sliding_window), jnp.integer
    ):
        raise ValueError(
            "sliding_window must be None or an integer scalar, got "
            f"{jnp.result_type(sliding_window)}{jnp.shape(sliding_window)}"
        )
    return jnp.asarray(sliding_window, jnp.int32).reshape(())


def reference_attention(
    sm_scale: float, logit_softcap: float | None = None, max_image_tokens: int = 0
):
    """The `attn` callable of the model contract (docs/design.md) for this backend;
    `max_image_tokens` > 0: image tokens of up to that many an image attend to their whole
    image (`md.image_groups`)."""
    ahead = blocks_ahead(max_image_tokens) if max_image_tokens else 0

    def attn(layer, q, k, v, kv_cache, md: AttentionMetadata, sliding_window=None, sinks=None):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        out = paged_attention(
            q, k, v, kv_cache, layer, md, sm_scale, logit_softcap, sliding_window, sinks, ahead
        )
        return out, kv_cache

    return attn
