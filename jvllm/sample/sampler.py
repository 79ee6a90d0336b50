"""On-device sampling: greedy, temperature, top-k, top-p and min-p with per-request seeds."""

import jax
import jax.numpy as jnp

from jvllm.sample.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


def _request_keys(seeds: jax.Array, output_index: jax.Array) -> jax.Array:
    """The key of a request's k-th output token: independent of the rest of the batch."""
    return jax.vmap(lambda s, k: jax.random.fold_in(jax.random.PRNGKey(s), k))(seeds, output_index)


def apply_top_k_top_p_min_p(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Mask f32[S, V] logits (already temperature-scaled) to each row's allowed set with -inf.

    As in vLLM: top-k first, then top-p over the renormalised top-k set, then min-p relative to
    the most likely token.
    """
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [S, V]
    k = jnp.where(md.top_k > 0, jnp.minimum(md.top_k, vocab), vocab)  # [S]
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    sorted_desc = jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [S, V]
    kept = mass_before < md.top_p[:, None]  # the first token is always kept
    num_kept = jnp.sum(kept, axis=-1)
    top_p_min = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, top_p_min)
    min_p_threshold = sorted_desc[:, :1] + jnp.log(jnp.maximum(md.min_p, 1e-38))[:, None]
    threshold = jnp.where(md.min_p[:, None] > 0, jnp.maximum(threshold, min_p_threshold), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Sample i32[S] token ids from f32[S, V] logits."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def random_sample() -> jax.Array:
        is_greedy = md.temperature < _GREEDY_EPS
        temperature = jnp.where(is_greedy, 1.0, md.temperature)
        scaled = apply_top_k_top_p_min_p(logits / temperature[:, None], md)
        keys = _request_keys(md.seeds, md.output_index)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:]))(keys)  # [S, V]
        sampled = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(is_greedy, greedy, sampled)

    return jax.lax.cond(md.all_greedy, lambda: greedy, random_sample)
