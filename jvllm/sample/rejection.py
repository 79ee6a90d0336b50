"""Rejection sampling of drafts that come with their draft distribution (vLLM's RejectionSampler;
Leviathan et al. 2023, Chen et al. 2023): the tokens it gives follow the target's distribution
exactly, whatever the draft's.

Nothing in the engine calls it yet. n-gram drafts are deterministic (q puts probability 1 on the
draft), and for them worker/draft_scoring.py samples the target's token at each position with the
sampler and accepts a draft while it equals it: the same distribution, and besides the same
tokens as decoding without speculation for a seeded request. Draft models and EAGLE / MTP heads,
whose drafts are sampled from a q, are what this is for (issue 49).
"""

import jax
import jax.numpy as jnp

from jvllm.sample.sampler import inverse_cdf, request_keys

# fold_in salts of an output index's key: the acceptance test's uniform and the draw of the
# token that ends the run (recovered or bonus).
_ACCEPT, _DRAW = 0, 1


def rejection_sample(
    draft_token_ids: jax.Array,
    num_drafts: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    seeds: jax.Array,
    output_index: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Accept each request's drafts d1..dk in order, d(i) with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the run's last token from
    normalize(max(p_i - q_i, 0)), or, all accepted, the bonus from p_k.

    draft_token_ids: i32[S, K], drawn from draft_probs; num_drafts: i32[S], k <= K of each
    request (the rest is padding); draft_probs: f32[S, K, V] the q each draft was drawn from;
    target_probs: f32[S, K + 1, V] the target's p at each draft's position and after the last
    (position k: the bonus's), after its processors, temperature and filters: what the sampler
    draws from (a greedy row's p one-hot on the argmax makes this the argmax rule); seeds: u32[S]
    and output_index: i32[S] (of each request's first draft): the key of output index o + i
    decides position i, as the sampler's does.

    Returns (token_ids i32[S, K + 1]: each run, -1 past it; num_tokens i32[S]: 1..k + 1).
    """
    num_seqs, max_drafts = draft_token_ids.shape
    positions = jnp.arange(max_drafts + 1)
    keys = request_keys(
        jnp.repeat(seeds, max_drafts + 1), (output_index[:, None] + positions).reshape(-1)
    )  # [S * (K + 1), 2]

    def uniforms(salt: int) -> jax.Array:  # f32[S, K + 1]
        salted = jax.vmap(lambda key: jax.random.fold_in(key, salt))(keys)
        return jax.vmap(jax.random.uniform)(salted).reshape(num_seqs, max_drafts + 1)

    pick = lambda probs: jnp.take_along_axis(probs, draft_token_ids[..., None], -1)[..., 0]
    target_p, draft_q = pick(target_probs[:, :max_drafts]), pick(draft_probs)  # [S, K]
    # u < p / q, without dividing (q > 0 where d was drawn from q).
    accepted = (uniforms(_ACCEPT)[:, :max_drafts] * draft_q < target_p) & (
        positions[:max_drafts] < num_drafts[:, None]
    )
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)  # [S]

    rows = jnp.arange(num_seqs)
    p = target_probs[rows, num_accepted]  # [S, V] the run's last position
    q = draft_probs[rows, jnp.minimum(num_accepted, max_drafts - 1)]
    q = jnp.where((num_accepted < num_drafts)[:, None], q, 0.0)  # all accepted: the bonus
    residual = jnp.maximum(p - q, 0.0)
    # p == q leaves nothing, and then rejecting had probability 0: rounding's case, drawn from p.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
    last = inverse_cdf(residual, uniforms(_DRAW)[rows, num_accepted])  # [S]

    drafts = jnp.pad(draft_token_ids, ((0, 0), (0, 1)))
    token_ids = jnp.where(positions < num_accepted[:, None], drafts, -1)
    token_ids = jnp.where(positions == num_accepted[:, None], last[:, None], token_ids)
    return token_ids, num_accepted + 1
