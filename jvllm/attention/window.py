"""Causal attention among a step's own tokens, read from k, v directly instead of the pages.

In a step with prefills most keys a query sees were computed in the same step. The flat tokens
are cut into blocks of WINDOW_BLOCK; each query block attends to the step's tokens of its own block
and the one before (same sequence, not later) in two batched matmuls for the whole step, with no
gather. Blocks whose sequence began further back in the step then attend to the earlier blocks in
spans of FAR_SPAN blocks, many (query block, span) pairs per matmul. Positions before the step
come from the pages (reference.py), and the two halves merge by their log-sum-exp, so the
result stays unnormalised.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jvllm.attention.matmul import batched_matmul
from jvllm.attention.metadata import AttentionMetadata

MASKED = -1e30
# Tokens per block of the step's own tokens: 128-token blocks ran a mixed-length workload 4%
# faster and the equal-length benchmark's 2048-token prefill step 10% slower (BENCHMARKS.md).
WINDOW_BLOCK = 64
# Blocks of keys a query block attends to at once beyond its window: [G*C, H] x [H, 2C] per KV
# head multiplies twice as fast as [G*C, H] x [H, C] on this CPU's YNNPACK; longer spans mask
# more keys away (attention of 880, 675, 493-token prompts, 30 layers: 1, 2, 3, 4 blocks a
# span with as many pairs a pass as fit 64 blocks: 672, 577-611, 659, 638-658 ms).
FAR_SPAN = 2
# (query block, span) pairs attended together in one pass of the loop over pairs.
_PAIRS_PER_PASS = 32


def soft_cap(scores: jax.Array, cap: float) -> jax.Array:
    """Gemma 2's logit soft-capping of scaled scores: cap * tanh(scores / cap)."""
    return cap * jnp.tanh(scores / cap)


def token_seq_and_position(md: AttentionMetadata, num_tokens: int):
    """Sequence id and absolute position of every flat token -> (i32[T], i32[T]); padding
    tokens get ids -1 - t, each its own, so that they see only themselves."""
    qsl = md.query_start_loc
    t = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), md.seq_lens.shape[0] - 1)
    position = md.seq_lens[seq] - (qsl[seq + 1] - t)
    is_real = t < qsl[-1]
    return jnp.where(is_real, seq, -1 - t), jnp.where(is_real, position, 0)


def block_spans(x: jax.Array, block: int, n: int, fill=0, ahead: bool = False) -> jax.Array:
    """x [NB*C, ...] -> [NB, n*C, ...]: for each block, the n blocks ending with it, or with
    `ahead` starting with it (blocks beyond either end are `fill`)."""
    x = x.reshape(-1, block, *x.shape[1:])
    pad = (0, n - 1) if ahead else (n - 1, 0)
    padded = jnp.pad(x, (pad,) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
    num_blocks = x.shape[0]
    return jnp.concatenate([padded[i : i + num_blocks] for i in range(n)], axis=1)


def attend_window(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    md: AttentionMetadata,
    sm_scale: float,
    logit_softcap: float | None = None,
    sliding_window: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T, N, H] to this step's k, v [T, K, H] of the same sequence, causally, all in the
    model dtype -> unnormalised (max f32[T, N], sum f32[T, N], weighted values f32[T, N, H]).

    Matmul operands keep the model dtype and accumulate in float32 (for bfloat16 about twice as
    fast as float32 on CPU). With a sliding window W (i32[], may be traced) a query at p sees
    only p - W < j <= p, and blocks wholly before every window of a query block are not visited.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block = min(num_tokens, WINDOW_BLOCK)
    num_blocks = -(-num_tokens // block)
    seq, position = token_seq_and_position(md, num_tokens)

    def padded(x, fill=0):  # [T, ...] -> [NB*C, ...]
        pad = ((0, num_blocks * block - num_tokens),) + ((0, 0),) * (x.ndim - 1)
        return jnp.pad(x, pad, constant_values=fill)

    dtype = k.dtype
    qb = padded(q).reshape(num_blocks, block, num_kv_heads, group, head_dim)
    qb = qb.transpose(0, 2, 3, 1, 4).reshape(num_blocks, num_kv_heads, group * block, head_dim)
    k, v = padded(k), padded(v)  # [NB*C, K, H]
    kw = block_spans(k, block, 2).transpose(0, 2, 1, 3)  # [NB, K, 2C, H]
    vw = block_spans(v, block, 2).transpose(0, 2, 1, 3)  # [NB, K, 2C, H]
    # Padding of the whole step and before the first block: ids no query has.
    seq_q = padded(seq, -1 - num_tokens).reshape(num_blocks, block)  # [NB, C]
    pos_q = padded(position).reshape(num_blocks, block)  # [NB, C]
    seq_k = block_spans(padded(seq, -2 - num_tokens), block, 2, -2 - num_tokens)  # [NB, 2C]
    pos_k = block_spans(padded(position), block, 2)  # [NB, 2C]
    visible = (seq_q[:, :, None] == seq_k[:, None, :]) & (pos_k[:, None, :] <= pos_q[:, :, None])
    if sliding_window is not None:
        visible &= pos_k[:, None, :] > pos_q[:, :, None] - sliding_window

    s = batched_matmul(qb, kw, y_transposed=True) * sm_scale  # [NB, K, G*C, 2C]
    s = s.reshape(num_blocks, num_kv_heads, group, block, 2 * block)  # [NB, K, G, C, 2C]
    if logit_softcap is not None:
        s = soft_cap(s, logit_softcap)
    s = jnp.where(visible[:, None, None], s, MASKED)
    m = s.max(-1)  # [NB, K, G, C]; every query sees at least itself
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    p = p.reshape(num_blocks, num_kv_heads, group * block, 2 * block).astype(dtype)
    acc = batched_matmul(p, vw).reshape(num_blocks, num_kv_heads, group, block, head_dim)

    if num_blocks > 2:
        depth = _block_depth(md, seq_q, block, sliding_window)  # [NB]
        far = _FarKeys(
            k=block_spans(k, block, FAR_SPAN).transpose(0, 2, 1, 3),  # [NB, K, SC, H]
            v=block_spans(v, block, FAR_SPAN).transpose(0, 2, 1, 3),  # [NB, K, SC, H]
            seq=block_spans(padded(seq, -2 - num_tokens), block, FAR_SPAN, -2 - num_tokens),
            pos=None if sliding_window is None else block_spans(padded(position), block, FAR_SPAN),
        )
        scores = _Scores(sm_scale, logit_softcap, sliding_window)
        m, l, acc = jax.lax.cond(
            jnp.any(depth > 1),
            lambda: _attend_far(qb, seq_q, pos_q, depth, far, scores, (m, l, acc)),
            lambda: (m, l, acc),
        )

    def to_flat(x):  # [NB, K, G, C, ...] -> [T, N, ...]
        x = jnp.moveaxis(x, 3, 1).reshape(num_blocks * block, num_heads, *x.shape[4:])
        return x[:num_tokens]

    return to_flat(m), to_flat(l), to_flat(acc)


def _block_depth(
    md: AttentionMetadata, seq_q: jax.Array, block: int, sliding_window: jax.Array | None
) -> jax.Array:
    """How many blocks before each query block [NB] its earliest sequence began in this step
    (the block's first token's sequence; padding blocks 0), and with a window W no further back
    than the block holding its first query's first key (flat index b*C - W + 1) -> i32[NB]."""
    first_seq = seq_q[:, 0]
    b = jnp.arange(seq_q.shape[0])
    first_block = md.query_start_loc[jnp.maximum(first_seq, 0)] // block
    if sliding_window is not None:
        first_block = jnp.maximum(first_block, (b * block - sliding_window + 1) // block)
    return jnp.where(first_seq >= 0, b - first_block, 0)


class _FarKeys(NamedTuple):
    """The FAR_SPAN blocks ending with each block (SC = FAR_SPAN * C)."""

    k: jax.Array  # [NB, K, SC, H]
    v: jax.Array  # [NB, K, SC, H]
    seq: jax.Array  # i32[NB, SC] sequence ids, as seq_k of the window
    pos: jax.Array | None  # i32[NB, SC] positions, with a sliding window only


class _Scores(NamedTuple):
    """How scores are made and masked beyond causality (see attend_window)."""

    sm_scale: float
    logit_softcap: float | None
    sliding_window: jax.Array | None


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] along the first axis, moved as uint16 bits when x is bfloat16: XLA:CPU gathers
    bfloat16 by converting the whole operand to float32 and back."""
    if x.dtype != jnp.bfloat16:
        return x[idx]
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits[idx], jnp.bfloat16)


def _far_pairs(depth: jax.Array, per_pass: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every (query block b, span ending at block b - 2 - FAR_SPAN * j) that holds one of the
    blocks b - 2 .. b - depth[b], listed first and padded to whole passes
    -> (query blocks i32[P], span ends i32[P], number of pairs i32[])."""
    num_blocks = depth.shape[0]
    b, j = jnp.meshgrid(jnp.arange(num_blocks), jnp.arange(num_blocks), indexing="ij")
    end = b - 2 - FAR_SPAN * j
    wanted = ((end >= 0) & (end >= b - depth[:, None])).reshape(-1)
    order = jnp.argsort(~wanted, stable=True)
    pad = (0, -order.shape[0] % per_pass)
    pairs = (jnp.pad(x.reshape(-1)[order], pad) for x in (b, end))
    return *pairs, jnp.sum(wanted)


def _attend_far(qb, seq_q, pos_q, depth, far: _FarKeys, scores: _Scores, window):
    """Carry the window's online softmax (max, sum [NB, K, G, C], weighted values [..., H]) on
    to blocks 2..depth before each query block qb [NB, K, G*C, H].

    The (query block, span) pairs go _PAIRS_PER_PASS at a time: a pass attends all of its pairs
    at once, then folds each pair into its query block by the log-sum-exp (a block may have
    several pairs in a pass). Keys of another sequence are masked, which also covers the part of
    a span before the block's sequence began, and so are keys before a query's sliding window.
    """
    num_blocks, num_kv_heads = qb.shape[:2]
    block = seq_q.shape[1]
    group = qb.shape[2] // block
    per_pass = min(_PAIRS_PER_PASS, num_blocks * num_blocks)
    query_block, span_end, num_pairs = _far_pairs(depth, per_pass)

    def attend_pairs(i, carry):
        m, l, acc = carry  # [NB, K, G, C], [NB, K, G, C], [NB, K, G, C, H]
        part = lambda a: jax.lax.dynamic_slice_in_dim(a, i * per_pass, per_pass)
        qi, ki = part(query_block), part(span_end)  # [PP]
        real = i * per_pass + jnp.arange(per_pass) < num_pairs
        s = batched_matmul(_take(qb, qi), _take(far.k, ki), y_transposed=True) * scores.sm_scale
        s = s.reshape(per_pass, num_kv_heads, group, block, -1)  # [PP, K, G, C, SC]
        if scores.logit_softcap is not None:
            s = soft_cap(s, scores.logit_softcap)
        visible = seq_q[qi][:, :, None] == far.seq[ki][:, None, :]  # [PP, C, SC]
        if scores.sliding_window is not None:
            visible &= far.pos[ki][:, None, :] > pos_q[qi][:, :, None] - scores.sliding_window
        s = jnp.where((visible & real[:, None, None])[:, None, None], s, MASKED)
        dest = jnp.where(real, qi, num_blocks)  # past-the-end pairs are dropped
        m_new = m.at[dest].max(s.max(-1), mode="drop")
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[qi][..., None])
        p_rows = p.reshape(per_pass, num_kv_heads, group * block, -1).astype(qb.dtype)
        pv = batched_matmul(p_rows, _take(far.v, ki)).reshape(p.shape[:-1] + (-1,))
        l = (l * correction).at[dest].add(p.sum(-1), mode="drop")
        acc = (acc * correction[..., None]).at[dest].add(pv, mode="drop")  # pv [PP, K, G, C, H]
        return m_new, l, acc

    num_passes = (num_pairs + per_pass - 1) // per_pass
    return jax.lax.fori_loop(0, num_passes, attend_pairs, window)
