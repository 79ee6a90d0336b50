"""MLA decode attention: one query per sequence over DeepSeek's latent KV cache.

The cache [L, 1, 1, P, B, C + R] holds a row a token: the normed KV latent (C dims), then the
rotated rope key (R dims) that every head shares. With the key up-projection absorbed into q
(jvllm/layers/mla.py), attention is multi-query attention of N heads over these rows, and a
row's latent part is also its value. So a program reads each block of rows once and uses the
latent part twice: in the scores, q_latent . latent + q_rope . rope, and as the values of the
online softmax. C + R (576) is not a power of two, as Triton blocks must be: the latent and the
rope part are loaded, and dotted with q's, as two slices.

Grid (head block, sequence, KV split). A program holds `heads_per_program` query heads, not all
N: its f32 accumulator is [heads, C], and N = 128 heads would make it [128, 512] (256 KiB, an
SM's whole register file). The head blocks of a (sequence, split) come first in launch order, so
they read the same pages at about the same time and all but the first read hit L2. Flash
decoding as in paged_decode_attention.py: splits of the pages, merged by log-sum-exp in JAX.
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
    dot_scores,
    kernel_scalars,
    next_power_of_2,
    online_softmax_update,
    pad_block_tables,
    validate_paged_inputs,
    without_operand,
)
from kernels_pallas.paged_decode_attention import paged_decode_attention_reference

# KV tokens per inner step, vLLM's Triton MLA decode tile: [32, 576] bfloat16 rows (36 KiB a
# pipeline stage); 16 for float32, to keep the tile's bytes. Pages larger than this are read
# a slice at a time.
_BLOCK_KV = 32
# Query heads per program: vLLM's Triton MLA decode block (16 heads, 4 warps), whose [16, 512]
# f32 accumulator stays in registers. Larger blocks read each page from L2 fewer times; `python
# -m kernels_pallas.bench_mla --sweep` times them.
_HEADS_PER_PROGRAM = 16


def _mla_decode_kernel(
    # inputs
    scalars_ref,  # i32[1]: layer
    seq_lens_ref,  # i32[S]
    block_tables_ref,  # i32[S, M + pages_per_block]
    q_latent_ref,  # [Hb, C]: this block's query heads, latent part (zero padded heads)
    q_rope_ref,  # [Hb, R]: their rope part
    kv_ref,  # [L, 1, 1, P, B, C + R]: the whole cache, read a block of rows at a time
    scales_ref,  # [L, 1, 1, P, B]: a quantized cache's scales; None for the others
    # outputs
    acc_ref,  # f32[Hb, C]: unnormalized output of this split
    max_ref,  # f32[Hb]: max logit (log2 units)
    sum_ref,  # f32[Hb]: softmax denominator relative to that max
    *,
    sm_scale: float,
    block_kv: int,
    pages_per_block: int,
    num_kv_splits: int,
):
    seq, split = pl.program_id(1), pl.program_id(2)
    layer = scalars_ref[0]
    page_size = kv_ref.shape[4]
    max_pages = block_tables_ref.shape[1] - pages_per_block
    num_rows, latent_dim = q_latent_ref.shape
    rope_dim = q_rope_ref.shape[1]

    # This split's positions first_pos:end_pos, in steps of block_kv; only the sequence's last
    # step is ragged.
    seq_len = jnp.minimum(seq_lens_ref[seq], max_pages * page_size)
    first_page, num_blocks = split_page_range(
        0, pl.cdiv(seq_len, page_size), split, num_kv_splits, pages_per_block
    )
    first_pos = first_page * page_size
    end_pos = jnp.minimum(first_pos + num_blocks * pages_per_block * page_size, seq_len)
    num_steps = pl.cdiv(jnp.maximum(end_pos - first_pos, 0), block_kv)

    q_latent, q_rope = q_latent_ref[...], q_rope_ref[...]

    def body(i, carry):
        pos = first_pos + i * block_kv
        rows = functools.partial(_load_rows, kv_ref, block_tables_ref, seq, layer, pos, block_kv)
        latent = rows(pl.ds(0, latent_dim))  # [Tk, C]: keys' first part, and the values
        rope = rows(pl.ds(latent_dim, rope_dim))  # [Tk, R]
        row_scales = None
        if scales_ref is not None:
            latent, rope = latent.astype(q_latent.dtype), rope.astype(q_rope.dtype)
            row_scales = _load_rows(scales_ref, block_tables_ref, seq, layer, pos, block_kv).astype(
                jnp.float32
            )  # [Tk]
        logits = dot_scores(q_latent, latent) + dot_scores(q_rope, rope)  # f32[Hb, Tk]
        if row_scales is not None:
            logits = logits * row_scales[None, :]
        is_valid = pos + jnp.arange(block_kv, dtype=jnp.int32) < end_pos  # [Tk]
        return online_softmax_update(
            logits, latent, is_valid[None, :], is_valid, carry, sm_scale, v_scales=row_scales
        )

    init = (
        jnp.zeros((num_rows, latent_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, num_steps, body, init)
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def _load_rows(ref, block_tables_ref, seq, layer, pos, block_kv: int, *cols):
    """Rows pos:pos + block_kv of sequence `seq` at `layer` from ref [L, 1, 1, P, B, ...] (the
    cache, and then `cols`, a pl.ds of its last dim, or its scales) -> [Tk, ...]: a slice of one
    page when pages hold at least block_kv rows, else block_kv / B whole pages."""
    page_size = ref.shape[4]
    if page_size >= block_kv:
        page = block_tables_ref[seq, pos // page_size]
        return ref[(layer, 0, 0, page, pl.ds(pos % page_size, block_kv), *cols)]
    pages = block_tables_ref[seq, pl.ds(pos // page_size, block_kv // page_size)]  # i32[n]
    block = ref[(layer, 0, 0, pages, slice(None), *cols)]  # [n, B, ...]
    return block.reshape(block_kv, *block.shape[2:])


def takes_latent_dims(latent_dim: int, head_dim: int) -> bool:
    """Whether the kernel takes rows of `head_dim` = C + R with C = `latent_dim`: both parts
    powers of two >= 16 (Triton blocks), as DeepSeek's 512 + 64."""
    return all(d >= MIN_DOT_DIM and not d & (d - 1) for d in (latent_dim, head_dim - latent_dim))


def _validate_latent_cache(name: str, kv_cache: jax.Array, latent_dim: int) -> int:
    """The checks past validate_paged_inputs' -> R, the rope dims."""
    if kv_cache.shape[1:3] != (1, 1):
        raise ValueError(
            f"{name}: kv_cache must be the latent cache [L, 1, 1, P, B, C + R] (one plane, one KV "
            f"head), got shape {kv_cache.shape}"
        )
    head_dim = kv_cache.shape[5]
    if not takes_latent_dims(latent_dim, head_dim):
        raise ValueError(
            f"{name}: latent_dim C and the rope dims R = H - C must be powers of two >= "
            f"{MIN_DOT_DIM} (Triton blocks), got C = {latent_dim}, R = {head_dim - latent_dim}"
        )
    return head_dim - latent_dim


def mla_decode_attention(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    latent_dim: int,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
    num_kv_splits: int | None = None,
    heads_per_program: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Multi-query attention of one absorbed query per sequence over the latent cache.

    q [S, N, C + R] (q_nope times the key up-projection, then the rotated q_rope); kv_cache
    [L, 1, 1, P, B, C + R] (C = latent_dim and R powers of two >= 16); layer i32[];
    block_tables i32[S, M]; seq_lens i32[S] (KV length including the query's own token; 0 =
    padding sequence). Returns [S, N, C] in q's dtype: softmax(q . rows * sm_scale) . rows[:, :C].

    kv_scales: None, or [L, 1, 1, P, B] float scales of an int8 / float8_e4m3fn kv_cache (a row
    is kv_cache * its scale), applied inside the kernel to each row it reads.
    num_kv_splits: None picks enough splits to fill the GPU. heads_per_program: None for the
    default (16), else a power of two >= 16; N is padded to a multiple of it.
    """
    name = "mla_decode_attention"
    page_size = validate_paged_inputs(name, q, kv_cache, layer, block_tables, seq_lens, kv_scales)[
        3
    ]
    rope_dim = _validate_latent_cache(name, kv_cache, latent_dim)
    num_seqs, num_heads, _ = q.shape
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{name}: q has S={num_seqs} rows but block_tables has {block_tables.shape[0]}"
        )
    heads_padded = max(MIN_DOT_DIM, next_power_of_2(num_heads))
    if heads_per_program is None:
        heads_per_program = _HEADS_PER_PROGRAM
    if heads_per_program < MIN_DOT_DIM or heads_per_program & (heads_per_program - 1):
        raise ValueError(
            f"{name}: heads_per_program must be a power of two >= {MIN_DOT_DIM}, got "
            f"{heads_per_program}"
        )
    heads_per_program = min(heads_per_program, heads_padded)
    num_head_blocks = heads_padded // heads_per_program
    block_kv = _BLOCK_KV * 2 // max(2, jnp.dtype(q.dtype).itemsize)
    pages_per_block = max(1, block_kv // page_size)
    num_blocks = pl.cdiv(block_tables.shape[1], pages_per_block)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(num_head_blocks * num_seqs, num_blocks)
    if num_kv_splits < 1:
        raise ValueError(f"{name}: num_kv_splits must be >= 1, got {num_kv_splits}")

    q = jnp.pad(q, ((0, 0), (0, heads_padded - num_heads), (0, 0)))
    q_latent, q_rope = q[..., :latent_dim], q[..., latent_dim:]  # [S, Np, C], [S, Np, R]

    kernel = functools.partial(
        _mla_decode_kernel,
        sm_scale=sm_scale,
        block_kv=block_kv,
        pages_per_block=pages_per_block,
        num_kv_splits=num_kv_splits,
    )
    kv_operands = [kv_cache]
    if kv_scales is None:
        kernel = without_operand(kernel, position=6)
    else:
        kv_operands.append(kv_scales)
    split_shape = (num_kv_splits, num_seqs, heads_padded)
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_head_blocks, num_seqs, num_kv_splits),
        in_specs=[
            pl.no_block_spec,  # layer
            pl.no_block_spec,  # seq_lens
            pl.no_block_spec,  # block_tables
            pl.BlockSpec((None, heads_per_program, latent_dim), lambda h, s, j: (s, h, 0)),
            pl.BlockSpec((None, heads_per_program, rope_dim), lambda h, s, j: (s, h, 0)),
            # kv_cache (and its scales): rows are gathered inside the kernel
            *[pl.no_block_spec] * len(kv_operands),
        ],
        out_specs=[
            pl.BlockSpec((None, None, heads_per_program, latent_dim), lambda h, s, j: (j, s, h, 0)),
            pl.BlockSpec((None, None, heads_per_program), lambda h, s, j: (j, s, h)),
            pl.BlockSpec((None, None, heads_per_program), lambda h, s, j: (j, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*split_shape, latent_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(
            num_warps=4 if heads_per_program <= _HEADS_PER_PROGRAM else 8, num_stages=2
        ),
        interpret=interpret,
        name="mla_decode_attention",
    )(
        kernel_scalars(layer, None),
        seq_lens,
        pad_block_tables(block_tables, pages_per_block),
        q_latent,
        q_rope,
        *kv_operands,
    )
    out = merge_kv_splits(acc, row_max, row_sum)[:, :num_heads]  # [S, N, C]
    return out.astype(q.dtype)


def mla_decode_attention_reference(
    q: jax.Array,
    kv_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    *,
    latent_dim: int,
    sm_scale: float,
    kv_scales: jax.Array | None = None,
) -> jax.Array:
    """Pure jnp: paged_decode_attention_reference over the latent cache, whose rows are the
    keys and the values, keeping the values' latent part -> [S, N, C]."""
    name = "mla_decode_attention_reference"
    validate_paged_inputs(name, q, kv_cache, layer, block_tables, seq_lens, kv_scales)
    _validate_latent_cache(name, kv_cache, latent_dim)
    out = paged_decode_attention_reference(
        q, kv_cache, layer, block_tables, seq_lens, sm_scale=sm_scale, kv_scales=kv_scales
    )
    return out[..., :latent_dim]
