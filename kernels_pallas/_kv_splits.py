"""Flash decoding: the decode kernels split each sequence's pages among several programs, so that
a small batch still fills the GPU, and merge the splits' partial softmaxes by log-sum-exp.

How many splits, which pages a split reads (inside a kernel), and the merge (plain JAX after it).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas._paging import next_power_of_2

# Enough programs for two waves on an H100 (132 SMs); past that, splitting only adds merge work.
_TARGET_NUM_PROGRAMS = 264
_MAX_KV_SPLITS = 16


def default_num_kv_splits(num_programs_per_split: int, num_blocks: int) -> int:
    """Splits that bring the grid to about _TARGET_NUM_PROGRAMS programs, a power of two, at
    most one per block of pages (a split reads whole blocks)."""
    wanted = pl.cdiv(_TARGET_NUM_PROGRAMS, num_programs_per_split)
    return max(1, min(next_power_of_2(wanted), _MAX_KV_SPLITS, num_blocks))


def split_page_range(
    start_page: jax.Array,
    num_pages: jax.Array,
    split: jax.Array,
    num_kv_splits: int,
    pages_per_block: int,
) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: the pages start_page:num_pages of one sequence, shared among the splits
    -> (first page, number of blocks of pages_per_block) of split `split`.

    Splits share the sequence's own pages (not M), so short and long sequences both use every
    split; a split's share is a whole number of blocks so that only the last block is ragged.
    """
    num_shared = jnp.maximum(num_pages - start_page, 0)
    pages_per_split = pl.cdiv(pl.cdiv(num_shared, num_kv_splits), pages_per_block) * pages_per_block
    first_page = start_page + split * pages_per_split
    end_page = jnp.minimum(first_page + pages_per_split, num_pages)
    return first_page, pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)


def merge_kv_splits(
    acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Log-sum-exp merge of flash-decoding splits.

    acc f32[J, ..., H]; row_max (log2 units), row_sum f32[J, ...] -> f32[..., H]. sinks: None
    or f32 logits (log2 units) broadcast against row_max[0], merged as one more split holding
    a key of that logit and no value (gpt-oss's attention sinks).
    """
    merged_max = row_max.max(axis=0)
    if sinks is not None:
        merged_max = jnp.maximum(merged_max, sinks)
    weights = jnp.exp2(row_max - merged_max)  # [J, ...]; 0 for splits that saw no key
    denominator = (weights * row_sum).sum(axis=0)
    if sinks is not None:
        denominator = denominator + jnp.exp2(sinks - merged_max)
    numerator = (weights[..., None] * acc).sum(axis=0)
    # Padding sequences (seq_len 0) have denominator 0: give them 0 rather than NaN.
    return numerator / jnp.where(denominator == 0, 1.0, denominator)[..., None]
