"""Causal attention among a step's own tokens, read from k, v directly instead of the pages.

In a step with prefills most keys a query sees were computed in the same step. The flat tokens
are cut into blocks of WINDOW_BLOCK; each query block attends to the step's tokens of its own block
and the one before (same sequence, not later) in two batched matmuls for the whole step, with no
gather and no loop. Positions before that window come from the pages (reference.py), and the two
halves merge by their log-sum-exp, so the result stays unnormalised here.
"""

import jax
import jax.numpy as jnp

from jvllm.attention.metadata import WINDOW_BLOCK, AttentionMetadata

MASKED = -1e30


def _token_seq_and_position(md: AttentionMetadata, num_tokens: int):
    """Sequence id and absolute position of every flat token -> (i32[T], i32[T]); padding
    tokens get ids -1 - t, each its own, so that they see only themselves."""
    qsl = md.query_start_loc
    t = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), md.seq_lens.shape[0] - 1)
    position = md.seq_lens[seq] - (qsl[seq + 1] - t)
    is_real = t < qsl[-1]
    return jnp.where(is_real, seq, -1 - t), jnp.where(is_real, position, 0)


def attend_window(
    q: jax.Array, k: jax.Array, v: jax.Array, md: AttentionMetadata, sm_scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, N, H] to this step's k, v [T, K, H] in each query's window, all in the model dtype
    -> unnormalised (max f32[T, N], sum f32[T, N], weighted values f32[T, N, H]).

    Matmul operands keep the model dtype and accumulate in float32 (for bfloat16 about twice as
    fast as float32 on CPU).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block = min(num_tokens, WINDOW_BLOCK)
    num_blocks = -(-num_tokens // block)
    pad = num_blocks * block - num_tokens
    seq, position = _token_seq_and_position(md, num_tokens)

    def blocks(x, fill=0):  # [T, ...] -> [NB, C, ...]
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
        return x.reshape(num_blocks, block, *x.shape[1:])

    def windows(x, fill=0):  # [T, ...] -> [NB, 2C, ...]: the block before, then the block
        x = blocks(x, fill)
        before = jnp.pad(x[:-1], ((1, 0),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
        return jnp.concatenate([before, x], axis=1)

    dtype = k.dtype
    qb = blocks(q.reshape(num_tokens, num_kv_heads, group, head_dim))
    qb = qb.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * block, head_dim)
    kw = windows(k).transpose(0, 2, 1, 3)  # [NB, K, 2C, H]
    vw = windows(v).transpose(0, 2, 1, 3)  # [NB, K, 2C, H]
    # Padding of the whole step and before the first block: ids no query has.
    seq_q, pos_q = blocks(seq, -1 - num_tokens), blocks(position)  # [NB, C]
    seq_k, pos_k = windows(seq, -2 - num_tokens), windows(position)  # [NB, 2C]
    visible = (seq_q[:, :, None] == seq_k[:, None, :]) & (pos_k[:, None, :] <= pos_q[:, :, None])

    s = jnp.einsum("bkqh,bkch->bkqc", qb, kw, preferred_element_type=jnp.float32) * sm_scale
    s = s.reshape(num_blocks, num_kv_heads, group, block, 2 * block)  # [NB, K, G, C, 2C]
    s = jnp.where(visible[:, None, None], s, MASKED)
    m = s.max(-1)  # [NB, K, G, C]; every query sees at least itself
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    acc = jnp.einsum(
        "bkqc,bkch->bkqh",
        p.reshape(num_blocks, num_kv_heads, group * block, 2 * block).astype(dtype),
        vw,
        preferred_element_type=jnp.float32,
    ).reshape(num_blocks, num_kv_heads, group, block, head_dim)

    def to_flat(x):  # [NB, K, G, C, ...] -> [T, N, ...]
        x = jnp.moveaxis(x, 3, 1).reshape(num_blocks * block, num_heads, *x.shape[4:])
        return x[:num_tokens]

    return to_flat(m), to_flat(l), to_flat(acc)
