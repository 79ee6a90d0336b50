"""The top-k / top-p / min-p filter: each row's smallest allowed logit, without a vocabulary sort.

XLA:CPU sorts a 64 x 49152 row batch in about 600 ms, longer than a whole decode step. So a
row's thresholds come from its 256 largest logits (`lax.top_k`, about 12 ms) whenever its kept
set provably lies among them, and otherwise from a bisection over the float order of the whole
row (32 masked counts or sums). Either way the threshold is one of the row's own logits, and which
way a row takes depends on that row alone, so a seeded request samples the same tokens in any
batch.
"""

import jax
import jax.numpy as jnp

from jvllm.sample.metadata import SamplingMetadata

_NUM_CANDIDATES = 256


def _top_k_size(md: SamplingMetadata, vocab: int) -> jax.Array:
    return jnp.where(md.top_k > 0, jnp.minimum(md.top_k, vocab), vocab)  # i32[S]


def _min_p_threshold(threshold: jax.Array, row_max: jax.Array, md: SamplingMetadata):
    min_p = row_max + jnp.log(jnp.maximum(md.min_p, 1e-38))[:, None]
    return jnp.where(md.min_p[:, None] > 0, jnp.maximum(threshold, min_p), threshold)


def _from_candidates(top: jax.Array, logits: jax.Array, md: SamplingMetadata):
    """Thresholds from top f32[S, C], the C largest logits of each row in descending order ->
    (threshold f32[S, 1], exact bool[S]); `exact` is False where the kept set may reach past the
    C-th logit. As in vLLM: top-k first, then top-p over the renormalised top-k set, then min-p
    relative to the most likely token."""
    num_cand, vocab = top.shape[-1], logits.shape[-1]
    k = _top_k_size(md, vocab)
    kth = jnp.take_along_axis(top, (jnp.minimum(k, num_cand) - 1)[:, None], axis=-1)  # [S, 1]
    kth = jnp.where(k[:, None] < vocab, kth, -jnp.inf)
    top = jnp.where(jnp.arange(num_cand)[None] < k[:, None], top, -jnp.inf)
    # The top-p normaliser sums the whole top-k set: the candidates hold it unless k > C, and
    # k = V is the whole row.
    log_norm = jnp.where(
        k <= num_cand, jax.nn.logsumexp(top, axis=-1), jax.nn.logsumexp(logits, axis=-1)
    )
    probs = jnp.exp(top - log_norm[:, None])  # [S, C]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < md.top_p[:, None], axis=-1)  # the first is always kept
    top_p_min = jnp.take_along_axis(top, (num_kept - 1)[:, None], axis=-1)
    top_p_min = jnp.where(md.top_p[:, None] < 1, top_p_min, -jnp.inf)
    threshold = _min_p_threshold(jnp.maximum(kth, top_p_min), top[:, :1], md)
    exact = ((k <= num_cand) | (k == vocab)) & ((md.top_p >= 1) | (num_kept < num_cand))
    return threshold, exact | (num_cand == vocab)


def _order_keys(x: jax.Array) -> jax.Array:
    """f32 -> u32 with the same order (negative floats have all bits flipped, others the sign)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(lo: jax.Array, hi: jax.Array, is_high) -> jax.Array:
    """Per row, the smallest u32 key in (lo, hi] with `is_high(key u32[S, 1]) -> bool[S]` true,
    given is_high false at lo and true at hi and monotone in between."""

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        high = is_high(mid[:, None])
        return jnp.where(high, lo, mid), jnp.where(high, mid, hi)

    return jax.lax.fori_loop(0, 32, body, (lo, hi))[1]


def _from_bisection(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The same thresholds as `_from_candidates` from the whole row -> f32[S, 1]."""
    vocab = logits.shape[-1]
    k = _top_k_size(md, vocab)
    keys = _order_keys(logits)  # [S, V]
    lowest, highest = keys.min(-1), keys.max(-1)  # [S]
    # The k-th largest logit: one below the smallest key with fewer than k logits at or above.
    kth_key = _bisect(lowest, highest + 1, lambda key: jnp.sum(keys >= key, axis=-1) < k) - 1
    kth_key = jnp.where(k < vocab, kth_key, lowest)
    in_top_k = keys >= kth_key[:, None]
    # Top-p: the smallest logit whose strictly larger ones hold less than top_p of the mass.
    log_norm = jax.nn.logsumexp(jnp.where(in_top_k, logits, -jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(in_top_k, jnp.exp(logits - log_norm), 0.0)  # [S, V]
    top_p_key = _bisect(
        kth_key - 1, highest, lambda key: jnp.sum(jnp.where(keys > key, probs, 0.0), -1) < md.top_p
    )
    top_p_key = jnp.where(md.top_p < 1, top_p_key, kth_key)
    threshold = _from_order_key(jnp.maximum(kth_key, top_p_key))[:, None]  # [S, 1]
    return _min_p_threshold(threshold, logits.max(-1, keepdims=True), md)


def apply_top_k_top_p_min_p(
    logits: jax.Array, md: SamplingMetadata, branch_free: bool = False
) -> jax.Array:
    """Mask f32[S, V] logits (already temperature-scaled) to each row's allowed set with -inf.
    The bisection runs only when some row needs it (a `lax.cond`), or, `branch_free`, always
    (sample/plan.py: no conditional in a planned step)."""
    num_cand = min(_NUM_CANDIDATES, logits.shape[-1])
    threshold, exact = _from_candidates(jax.lax.top_k(logits, num_cand)[0], logits, md)

    def with_bisection():
        return jnp.where(exact[:, None], threshold, _from_bisection(logits, md))

    if branch_free:
        threshold = with_bisection()
    else:
        threshold = jax.lax.cond(jnp.all(exact), lambda: threshold, with_bisection)
    return jnp.where(logits >= threshold, logits, -jnp.inf)
