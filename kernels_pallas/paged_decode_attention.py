"""Paged decode attention (one query per sequence) over the engine's whole-model KV cache.

Flash decoding: one program per (sequence, KV head, KV split) runs an online softmax over its share
of the sequence's pages for the G query heads of that KV head at once (one dot of [Gp, H] x [H, C]
instead of G matrix-vector products), then plain JAX merges the splits by log-sum-exp.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas._kv_splits import default_num_kv_splits, merge_kv_splits, split_page_range
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

# KV tokens per inner-loop step: large enough to keep many loads in flight, small enough that the
# [C, H] K and V tiles stay in registers at H = 128 (fewer for wider heads: kv_tokens_per_step).
_BLOCK_KV = 128


def _decode_kernel(
    # inputs
    scalars_ref,  # i32[1] layer, or i32[2] layer and sliding window (see kernel_scalars)
    seq_lens_ref,  # i32[S]
    block_tables_ref,  # i32[S, M + pages_per_block]
    q_ref,  # [Gp, Hp]: the query heads of this KV head, zero padded
    kv_ref,  # [L, 2 or 1, K, P, B, H]: the whole cache, read page by page
    scales_ref,  # [L, 2 or 1, K, P, B]: a quantized cache's scales; None for the others
    # outputs
    acc_ref,  # f32[Gp, Hp]: unnormalized output of this split
    max_ref,  # f32[Gp]: max logit (log2 units)
    sum_ref,  # f32[Gp]: softmax denominator relative to that max
    *,
    sm_scale: float,
    logit_softcap: float | None,
    is_windowed: bool,
    pages_per_block: int,
    num_kv_splits: int,
):
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = scalars_ref[0]
    seq_len = seq_lens_ref[seq]
    page_size = kv_ref.shape[4]
    max_pages = block_tables_ref.shape[1] - pages_per_block
    block_kv = pages_per_block * page_size
    num_rows, head_dim_padded = q_ref.shape

    # With a window, the splits share only the pages from the one holding the first key it lets
    # through.
    num_pages = jnp.minimum(pl.cdiv(seq_len, page_size), max_pages)
    start_page = 0
    if is_windowed:
        kv_start = jnp.maximum(seq_len - scalars_ref[1], 0)  # first position the query sees
        start_page = kv_start // page_size
    first_page, num_blocks = split_page_range(
        start_page, num_pages, split, num_kv_splits, pages_per_block
    )

    q = q_ref[...]

    def body(i, carry):
        page = first_page + i * pages_per_block
        pages = block_tables_ref[seq, pl.ds(page, pages_per_block)]  # i32[pages_per_block]
        k, v, kv_scales = load_kv(kv_ref, scales_ref, layer, head, pages, head_dim_padded)
        positions = page * page_size + jnp.arange(block_kv, dtype=jnp.int32)
        is_valid = positions < seq_len  # [C]
        if is_windowed:
            is_valid = is_valid & (positions >= kv_start)
        return online_softmax_step(
            q,
            k,
            v,
            is_valid[None, :],
            is_valid,
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
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def paged_decode_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
    sliding_window: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    num_kv_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one new query per sequence over its paged KV.

    q [S, N, H]; kv_cache [L, 2, K, P, B, H], or [L, 1, K, P, B, H] whose one plane is both K and
    V (MLA's latent cache); layer i32[]; block_tables i32[S, M]; seq_lens i32[S] (KV length
    including the query's own token; 0 = padding sequence). Returns [S, N, H] in q's dtype.
    `num_kv_splits=None` picks enough splits to fill the GPU.

    kv_scales: None, or kv_cache's [L, 2 or 1, K, P, B] float scales of an int8 / float8_e4m3fn
    kv_cache (a value is kv_cache * its scale), applied inside the kernel to each page it reads.

    sliding_window: None, or i32[] W (may be traced): the query sees only its last W positions,
    itself included, and only their pages are read. logit_softcap: None, or a static cap for
    cap * tanh(logit / cap) on the scaled logits (Gemma 2).

    sinks: None, or [N] float logits (may be traced), one more key per query head with no value,
    not scaled or capped (gpt-oss). They join the splits' merge, so the kernel is the same.
    """
    name = "paged_decode_attention"
    _, num_kv_heads, _, page_size, head_dim, group = validate_paged_inputs(
        name, q, kv_cache, layer, block_tables, seq_lens, kv_scales
    )
    validate_attention_options(name, sliding_window, logit_softcap)
    num_seqs, num_heads, _ = q.shape
    validate_sinks(name, sinks, num_heads)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{name}: q has S={num_seqs} rows but block_tables has {block_tables.shape[0]}"
        )
    # Triton blocks are powers of two and dots need >= 16 rows: pad G and H of q (not the cache).
    group_padded = max(MIN_DOT_DIM, next_power_of_2(group))
    head_dim_padded = max(MIN_DOT_DIM, next_power_of_2(head_dim))
    max_pages = block_tables.shape[1]
    pages_per_block = max(1, kv_tokens_per_step(_BLOCK_KV, head_dim_padded) // page_size)
    num_blocks = pl.cdiv(max_pages, pages_per_block)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_seqs * num_kv_heads, num_blocks)
    if num_kv_splits < 1:
        raise ValueError(f"{name}: num_kv_splits must be >= 1, got {num_kv_splits}")

    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_padded - group), (0, head_dim_padded - head_dim)))

    kernel = functools.partial(
        _decode_kernel,
        sm_scale=sm_scale,
        logit_softcap=logit_softcap,
        is_windowed=sliding_window is not None,
        pages_per_block=pages_per_block,
        num_kv_splits=num_kv_splits,
    )
    kv_operands = [kv_cache]
    if kv_scales is None:
        kernel = without_operand(kernel, position=5)
    else:
        kv_operands.append(kv_scales)
    split_shape = (num_kv_splits, num_seqs, num_kv_heads, group_padded)
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_kv_splits),
        in_specs=[
            pl.no_block_spec,  # layer (and window)
            pl.no_block_spec,  # seq_lens
            pl.no_block_spec,  # block_tables
            pl.BlockSpec((None, None, group_padded, head_dim_padded), lambda s, k, j: (s, k, 0, 0)),
            # kv_cache (and its scales): pages are gathered inside the kernel
            *[pl.no_block_spec] * len(kv_operands),
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, group_padded, head_dim_padded), lambda s, k, j: (j, s, k, 0, 0)
            ),
            pl.BlockSpec((None, None, None, group_padded), lambda s, k, j: (j, s, k, 0)),
            pl.BlockSpec((None, None, None, group_padded), lambda s, k, j: (j, s, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, head_dim_padded), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps_for(head_dim_padded), num_stages=2
        ),
        interpret=interpret,
        name="paged_decode_attention",
    )(
        kernel_scalars(layer, sliding_window),
        seq_lens,
        pad_block_tables(block_tables, pages_per_block),
        qg,
        *kv_operands,
    )
    if sinks is not None:
        sinks = sinks_per_kv_head(sinks, num_kv_heads, group_padded)  # [K, Gp]
    out = merge_kv_splits(acc, row_max, row_sum, sinks)[:, :, :group, :head_dim]  # [S, K, G, H]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


def paged_decode_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
    sliding_window: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pure jnp: gather every page of the block table (dequantized with kv_scales), dense softmax
    masked by seq_len (and the window: positions >= seq_len - W), with the sinks if any."""
    name = "paged_decode_attention_reference"
    page_size = validate_paged_inputs(name, q, kv_cache, layer, block_tables, seq_lens, kv_scales)[
        3
    ]
    validate_attention_options(name, sliding_window, logit_softcap)
    validate_sinks(name, sinks, q.shape[1])
    max_len = block_tables.shape[1] * page_size
    layer = jnp.asarray(layer, jnp.int32).reshape(())

    def one_sequence(q_s, pages, seq_len):  # [N, H], i32[M], i32[]
        keys, values = sequence_kv(kv_cache, kv_scales, layer, pages)  # each [C, K, H]
        positions = jnp.arange(max_len)
        is_visible = positions < seq_len  # [C]
        if sliding_window is not None:
            is_visible &= positions >= seq_len - jnp.asarray(sliding_window).reshape(())
        return reference_attention(
            q_s[None], keys, values, is_visible[None, :], sm_scale, logit_softcap, sinks
        )[0]

    out = jax.vmap(one_sequence)(q, block_tables, seq_lens)  # [S, N, H]
    return out.astype(q.dtype)
