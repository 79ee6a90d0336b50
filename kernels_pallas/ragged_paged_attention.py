"""Ragged paged attention: mixed prefill, chunked prefill and decode in one call.

The queries of all sequences are flattened into q [T, N, H]; sequence s owns rows
query_start_loc[s]:query_start_loc[s+1], the last q_len of its seq_lens[s] KV positions (causal).
A tile is up to `block_q` consecutive queries of one sequence; one program per (tile, KV head) runs
an online softmax over the pages up to the tile's causal limit, with the [block_q, G] query heads of
that KV head flattened into the rows of one dot. The tile -> sequence map is computed in jnp from
query_start_loc, over a static number of tiles (cdiv(T, block_q) + S bounds it; spare tiles idle).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._paging import (
    MASK_VALUE,
    MIN_DOT_DIM,
    kernel_scalars,
    kv_tokens_per_step,
    load_kv,
    next_power_of_2,
    num_warps_for,
    online_softmax_step,
    pad_block_tables,
    reference_attention,
    sequence_kv,
    sinks_per_kv_head,
    validate_attention_options,
    validate_paged_inputs,
    validate_sinks,
    without_operand,
)

# Rows (queries x query heads) per tile and KV tokens per inner step: the FlashAttention-2 Triton
# tile sizes that keep a [64, 128] f32 accumulator and [64, 128] K, V tiles in registers (fewer KV
# tokens for wider heads: kv_tokens_per_step).
_BLOCK_ROWS = 64
_BLOCK_KV = 64


def _ragged_kernel(
    # inputs
    scalars_ref,  # i32[1] layer, or i32[2] layer and sliding window (see kernel_scalars)
    seq_lens_ref,  # i32[S]
    block_tables_ref,  # i32[S, M + pages_per_block]
    tile_seq_ref,  # i32[num_tiles]: sequence of the tile
    tile_q_start_ref,  # i32[num_tiles]: row in q of the tile's first query
    tile_num_q_ref,  # i32[num_tiles]: queries in the tile (0 for a spare tile)
    tile_pos_ref,  # i32[num_tiles]: KV position of the tile's first query
    q_ref,  # [T + block_q, K, Gp, Hp]: all queries, zero padded
    kv_ref,  # [L, 2 or 1, K, P, B, H]: the whole cache, read page by page
    scales_ref,  # [L, 2 or 1, K, P, B]: a quantized cache's scales; None for the others
    sinks_ref,  # f32[block_q * Gp]: each row's sink logit (log2 units); None without sinks
    # outputs
    o_ref,  # [block_q * Gp, Hp]: rows ordered (query, query head)
    *,
    sm_scale: float,
    logit_softcap: float | None,
    is_windowed: bool,
    block_q: int,
    pages_per_block: int,
):
    tile, head = pl.program_id(0), pl.program_id(1)
    layer = scalars_ref[0]
    seq = tile_seq_ref[tile]
    num_q = tile_num_q_ref[tile]
    first_pos = tile_pos_ref[tile]
    page_size = kv_ref.shape[4]
    max_pages = block_tables_ref.shape[1] - pages_per_block
    block_kv = pages_per_block * page_size
    _, _, group_padded, head_dim_padded = q_ref.shape
    num_rows = block_q * group_padded

    q = q_ref[pl.ds(tile_q_start_ref[tile], block_q), head].reshape(num_rows, head_dim_padded)
    row_query = jnp.arange(num_rows, dtype=jnp.int32) // group_padded  # [R]
    row_pos = first_pos + row_query
    is_row_valid = row_query < num_q

    # Causal: the tile's last query sees positions < first_pos + num_q, and nothing past seq_len.
    kv_end = jnp.minimum(jnp.minimum(seq_lens_ref[seq], first_pos + num_q), max_pages * page_size)
    kv_end = jnp.where(num_q > 0, kv_end, 0)
    if is_windowed:
        # A query at p sees p - W < j <= p: start at the page of the tile's first query's first key.
        window = scalars_ref[1]
        first_page = jnp.maximum(first_pos - window + 1, 0) // page_size
        num_blocks = pl.cdiv(jnp.maximum(kv_end - first_page * page_size, 0), block_kv)
    else:
        num_blocks = pl.cdiv(jnp.maximum(kv_end, 0), block_kv)

    def body(i, carry):
        page = i * pages_per_block
        if is_windowed:
            page = first_page + page
        pages = block_tables_ref[seq, pl.ds(page, pages_per_block)]  # i32[pages_per_block]
        k, v, kv_scales = load_kv(kv_ref, scales_ref, layer, head, pages, head_dim_padded)
        positions = page * page_size + jnp.arange(block_kv, dtype=jnp.int32)  # [C]
        is_valid_kv = positions < kv_end
        is_visible = (
            (positions[None, :] <= row_pos[:, None]) & is_row_valid[:, None] & is_valid_kv[None, :]
        )  # [R, C]
        if is_windowed:
            is_visible &= positions[None, :] > row_pos[:, None] - window
        return online_softmax_step(
            q,
            k,
            v,
            is_visible,
            is_valid_kv,
            *carry,
            sm_scale=sm_scale,
            logit_softcap=logit_softcap,
            kv_scales=kv_scales,
        )

    init = (
        jnp.zeros((num_rows, head_dim_padded), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_blocks, body, init)
    if sinks_ref is not None:
        acc, row_sum = _fold_sinks(acc, row_max, row_sum, sinks_ref[...])
    o_ref[...] = (acc / jnp.where(row_sum == 0, 1.0, row_sum)[:, None]).astype(o_ref.dtype)


def _fold_sinks(
    acc: jax.Array,  # f32[R, Hp], unnormalized output
    row_max: jax.Array,  # f32[R], log2 units
    row_sum: jax.Array,  # f32[R]
    sinks: jax.Array,  # f32[R], log2 units
) -> tuple[jax.Array, jax.Array]:
    """The online softmax with one more key per row, of logit `sinks` and no value -> (acc,
    row_sum) relative to the new max; a row that saw no key gets sum 1 and output 0."""
    max_next = jnp.maximum(row_max, sinks)
    alpha = jnp.exp2(row_max - max_next)
    return alpha[:, None] * acc, alpha * row_sum + jnp.exp2(sinks - max_next)


def _tile_schedule(
    query_start_loc: jax.Array, seq_lens: jax.Array, block_q: int, num_tiles: int
) -> tuple[jax.Array, ...]:
    """Splits each sequence's queries into tiles of block_q.

    Returns per tile i32[num_tiles]: sequence, first q row, number of queries, first KV position;
    and per sequence i32[S]: its first tile.
    """
    num_seqs = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tiles_per_seq = pl.cdiv(jnp.maximum(q_lens, 0), block_q)
    tile_end = jnp.cumsum(tiles_per_seq)
    tile_begin = tile_end - tiles_per_seq
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_end, tiles, side="right"), num_seqs - 1)
    index_in_seq = tiles - tile_begin[seq]
    q_start = query_start_loc[seq] + index_in_seq * block_q
    num_q = jnp.minimum(block_q, query_start_loc[seq + 1] - q_start)
    is_real = tiles < tile_end[-1]
    first_pos = seq_lens[seq] - q_lens[seq] + index_in_seq * block_q
    return (
        seq.astype(jnp.int32),
        jnp.where(is_real, q_start, 0).astype(jnp.int32),
        jnp.where(is_real, num_q, 0).astype(jnp.int32),
        first_pos.astype(jnp.int32),
        tile_begin.astype(jnp.int32),
    )


def _validate_query_start_loc(name: str, query_start_loc: jax.Array, num_seqs: int) -> None:
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != jnp.int32:
        raise ValueError(
            f"{name}: query_start_loc must be i32[S+1] with S={num_seqs}, "
            f"got {query_start_loc.dtype}{query_start_loc.shape}"
        )


def ragged_paged_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
    sliding_window: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of flattened ragged queries over their sequences' paged KV.

    q [T, N, H]; kv_cache [L, 2, K, P, B, H], or [L, 1, K, P, B, H] whose one plane is both K and
    V (MLA's latent cache); layer i32[]; block_tables i32[S, M]; seq_lens i32[S] (KV length after
    this step; 0 = padding); query_start_loc i32[S+1]. Returns [T, N, H] in q's dtype; rows past
    query_start_loc[S] are padding and come back as 0.

    kv_scales: None, or kv_cache's [L, 2 or 1, K, P, B] float scales of an int8 / float8_e4m3fn
    kv_cache (a value is kv_cache * its scale), applied inside the kernel to each page it reads.

    sliding_window: None, or i32[] W (may be traced): a query at position p sees p - W < j <= p,
    and a tile reads pages only from its first query's window on. logit_softcap: None, or a static
    cap for cap * tanh(logit / cap) on the scaled logits (Gemma 2).

    sinks: None, or [N] float logits (may be traced), one more key per query head with no value,
    not scaled or capped (gpt-oss), folded in before each tile's rows are normalized.
    """
    name = "ragged_paged_attention"
    _, num_kv_heads, _, page_size, head_dim, group = validate_paged_inputs(
        name, q, kv_cache, layer, block_tables, seq_lens, kv_scales
    )
    validate_attention_options(name, sliding_window, logit_softcap)
    num_tokens, num_heads, _ = q.shape
    validate_sinks(name, sinks, num_heads)
    num_seqs = block_tables.shape[0]
    _validate_query_start_loc(name, query_start_loc, num_seqs)

    group_padded = next_power_of_2(group)
    head_dim_padded = max(MIN_DOT_DIM, next_power_of_2(head_dim))
    # At least 16 rows for the Triton dot, even for one query with G = 1.
    block_q = max(1, _BLOCK_ROWS // group_padded)
    num_rows = block_q * group_padded
    pages_per_block = max(1, kv_tokens_per_step(_BLOCK_KV, head_dim_padded) // page_size)
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs
    tile_seq, tile_q_start, tile_num_q, tile_pos, seq_first_tile = _tile_schedule(
        query_start_loc, seq_lens, block_q, num_tiles
    )

    # Rows past T keep the last tile's [block_q] slice in bounds.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(
        qg, ((0, block_q), (0, 0), (0, group_padded - group), (0, head_dim_padded - head_dim))
    )
    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=sm_scale,
        logit_softcap=logit_softcap,
        is_windowed=sliding_window is not None,
        block_q=block_q,
        pages_per_block=pages_per_block,
    )
    kv_operands, sink_operands, sink_specs = [kv_cache], [], []
    if sinks is None:
        kernel = without_operand(kernel, position=10)
    else:
        # Each row's sink, rows ordered (query, query head) as q's: [K, block_q * Gp].
        row_sinks = jnp.tile(sinks_per_kv_head(sinks, num_kv_heads, group_padded), block_q)
        sink_operands.append(row_sinks)
        sink_specs.append(pl.BlockSpec((None, num_rows), lambda t, k: (k, 0)))
    if kv_scales is None:
        kernel = without_operand(kernel, position=9)
    else:
        kv_operands.append(kv_scales)
    out_tiles = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        # every operand but the sinks is indexed inside the kernel
        in_specs=[pl.no_block_spec] * (8 + len(kv_operands)) + sink_specs,
        out_specs=pl.BlockSpec((None, None, num_rows, head_dim_padded), lambda t, k: (t, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(
            (num_tiles, num_kv_heads, num_rows, head_dim_padded), q.dtype
        ),
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps_for(head_dim_padded), num_stages=2
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        kernel_scalars(layer, sliding_window),
        seq_lens,
        pad_block_tables(block_tables, pages_per_block),
        tile_seq,
        tile_q_start,
        tile_num_q,
        tile_pos,
        qg,
        *kv_operands,
        *sink_operands,
    )

    # Back from tiles to rows of q: row r of sequence s is query (r - start_s) of s.
    out_tiles = out_tiles.reshape(num_tiles, num_kv_heads, block_q, group_padded, head_dim_padded)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    row_seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], rows, side="right"), num_seqs - 1)
    offset = rows - query_start_loc[row_seq]
    row_tile = jnp.clip(seq_first_tile[row_seq] + offset // block_q, 0, num_tiles - 1)
    out = out_tiles[row_tile, :, offset % block_q]  # [T, K, Gp, Hp]
    out = out[:, :, :group, :head_dim].reshape(num_tokens, num_heads, head_dim)
    is_padding_row = rows >= query_start_loc[-1]
    return jnp.where(is_padding_row[:, None, None], jnp.zeros_like(out), out)


def ragged_paged_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
    sliding_window: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pure jnp: every query gathers its sequence's pages (dequantized with kv_scales) and runs
    a dense causal softmax (query at p sees p - W < j <= p with a window W), with the sinks if
    any."""
    name = "ragged_paged_attention_reference"
    page_size = validate_paged_inputs(name, q, kv_cache, layer, block_tables, seq_lens, kv_scales)[
        3
    ]
    validate_attention_options(name, sliding_window, logit_softcap)
    validate_sinks(name, sinks, q.shape[1])
    num_seqs = block_tables.shape[0]
    _validate_query_start_loc(name, query_start_loc, num_seqs)
    max_len = block_tables.shape[1] * page_size
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    row_seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], rows, side="right"), num_seqs - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    row_pos = seq_lens[row_seq] - q_lens[row_seq] + rows - query_start_loc[row_seq]
    is_real_row = rows < query_start_loc[-1]

    def one_query(q_t, pages, pos, is_real):  # [N, H], i32[M], i32[], bool[]
        keys, values = sequence_kv(kv_cache, kv_scales, layer, pages)  # each [C, K, H]
        positions = jnp.arange(max_len)
        is_visible = (positions <= pos) & is_real  # [C]
        if sliding_window is not None:
            is_visible &= positions > pos - jnp.asarray(sliding_window).reshape(())
        return reference_attention(
            q_t[None], keys, values, is_visible[None, :], sm_scale, logit_softcap, sinks
        )[0]

    out = jax.vmap(one_query)(q, block_tables[row_seq], row_pos, is_real_row)  # [T, N, H]
    return out.astype(q.dtype)
