"""Pure-JAX paged attention over the block tables: the engine's portable backend.

Queries arrive flat ([T, N, H]); those that read pages are regrouped into tiles of one sequence
each ([NT, Q]), which walk their sequence's pages with an online softmax (page_walk.py), or
through the native CPU kernel where it applies (cpu_decode.py). In steps with prefills the
step's recent tokens are attended directly from k, v (window.py), which XLA:CPU runs as dense
matmuls: page gathers are what cost.
"""

import jax
import jax.numpy as jnp

from jvllm.attention import cpu_decode, page_walk
from jvllm.attention.image_ahead import attend_image_ahead, blocks_ahead, merge_partials
from jvllm.attention.kv_pages import write_kv
from jvllm.attention.kv_quant import KVCache, QuantizedKVCache, kv_values
from jvllm.attention.metadata import AttentionMetadata
from jvllm.attention.window import MASKED, attend_window, token_seq_and_position

# Tiles attended together in one pass of the page loop, in decode steps and in steps with
# prefills. The latter use few tiles (a sequence's queries all read the same positions of
# earlier steps from the pages, and there are few decodes): blocks of 8 ran such a step's
# attention 1105 -> 772 ms (30 layers) where 32 gathered pages for padding tiles.
_DECODE_TILE_BLOCK = 32
_MIXED_TILE_BLOCK = 8


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
        (out,) = page_walk.attend_pages(
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
                flat = page_walk.attend_pages(
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
