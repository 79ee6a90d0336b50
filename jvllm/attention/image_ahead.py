"""Bidirectional attention within each image (Gemma 3): an image token also attends to the
tokens of its image that come after it in the step, beside its causal attention.

An image's tokens are scheduled in one step (the scheduler does not cut through an image of
such a model), so the keys ahead of a query are the step's own: the flat tokens are cut into
blocks of AHEAD_BLOCK, and each query block attends to its own block and the blocks after it
that an image can reach, keys masked to the query's image and beyond the query. The result is
unnormalised, merged with the causal halves by their log-sum-exp (reference.py); a query that
is not an image token sees no key here (max MASKED, sum 0), which the merge weighs at 0.
"""

import jax
import jax.numpy as jnp

from jvllm.attention.matmul import batched_matmul
from jvllm.attention.window import MASKED, block_spans, soft_cap

AHEAD_BLOCK = 64


def blocks_ahead(max_image_tokens: int) -> int:
    """Blocks a query block reads (its own included) to reach the end of any image of up to
    `max_image_tokens` tokens that one of its queries belongs to."""
    return 1 + -(-(max_image_tokens - 1) // AHEAD_BLOCK)


def attend_image_ahead(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    image_groups: jax.Array,
    num_blocks_ahead: int,
    sm_scale: float,
    logit_softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, N, H] to the keys of this step's k, v [T, K, H] that share its image (image_groups
    i32[T]: the image of each image token, -1 for every other token) and come after it ->
    unnormalised (max f32[T, N], sum f32[T, N], weighted values f32[T, N, H])."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block = min(num_tokens, AHEAD_BLOCK)
    num_blocks = -(-num_tokens // block)
    n = min(num_blocks_ahead, num_blocks)

    def padded(x, fill=0):  # [T, ...] -> [NB*C, ...]
        pad = ((0, num_blocks * block - num_tokens),) + ((0, 0),) * (x.ndim - 1)
        return jnp.pad(x, pad, constant_values=fill)

    qb = padded(q).reshape(num_blocks, block, num_kv_heads, group, head_dim)
    qb = qb.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * block, head_dim)
    kb = block_spans(padded(k), block, n, ahead=True).transpose(0, 2, 1, 3)  # [NB, K, nC, H]
    vb = block_spans(padded(v), block, n, ahead=True).transpose(0, 2, 1, 3)
    index = jnp.arange(num_blocks * block)
    group_q = padded(image_groups, -1).reshape(num_blocks, block)  # [NB, C]
    index_q = index.reshape(num_blocks, block)
    group_k = block_spans(padded(image_groups, -1), block, n, -1, ahead=True)  # [NB, nC]
    index_k = block_spans(index, block, n, -1, ahead=True)
    visible = (
        (group_q[:, :, None] >= 0)
        & (group_q[:, :, None] == group_k[:, None, :])
        & (index_k[:, None, :] > index_q[:, :, None])
    )  # [NB, C, nC]
    s = batched_matmul(qb, kb, y_transposed=True) * sm_scale  # [NB, K, G*C, nC]
    s = s.reshape(num_blocks, num_kv_heads, group, block, n * block)
    if logit_softcap is not None:
        s = soft_cap(s, logit_softcap)
    s = jnp.where(visible[:, None, None], s, MASKED)
    m = s.max(-1)  # [NB, K, G, C]
    p = jnp.where(visible[:, None, None], jnp.exp(s - m[..., None]), 0.0)
    l = p.sum(-1)
    p = p.reshape(num_blocks, num_kv_heads, group * block, n * block).astype(k.dtype)
    acc = batched_matmul(p, vb).reshape(num_blocks, num_kv_heads, group, block, head_dim)

    def to_flat(x):  # [NB, K, G, C, ...] -> [T, N, ...]
        x = jnp.moveaxis(x, 3, 1).reshape(num_blocks * block, num_heads, *x.shape[4:])
        return x[:num_tokens]

    return to_flat(m), to_flat(l), to_flat(acc)


def merge_partials(first: tuple, second: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two unnormalised attentions of the same queries to disjoint keys, each (max f32[T, N],
    sum f32[T, N], weighted values f32[T, N, H]) -> the same of all their keys."""
    (m1, l1, acc1), (m2, l2, acc2) = first, second
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)  # [T, N]
    return m, l1 * a1 + l2 * a2, acc1 * a1[..., None] + acc2 * a2[..., None]
