"""Logprobs on device: top-k of the raw log-softmax plus the logprob and rank of a chosen token."""

import jax
import jax.numpy as jnp

# Prompt positions whose logits are materialised at once (bounds memory at [chunk, V]).
PROMPT_LOGPROBS_CHUNK = 128


def topk_and_target(
    logits: jax.Array, target_ids: jax.Array, k: int, as_logits: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For f32[R, V] logits and i32[R] targets (-1 = none):
    (i32[R, k] top ids, f32[R, k] top logprobs, f32[R] target logprob, i32[R] target rank);
    `as_logits`: the logits themselves in place of logprobs (the same order).

    The rank counts the tokens at least as likely as the target, as vLLM does (1 = the best).
    """
    logprobs = logits.astype(jnp.float32)
    if not as_logits:
        logprobs = jax.nn.log_softmax(logprobs, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    safe_target = jnp.maximum(target_ids, 0)
    target_lp = jnp.take_along_axis(logprobs, safe_target[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs >= target_lp[:, None], axis=-1).astype(jnp.int32)
    return top_ids.astype(jnp.int32), top_lp, target_lp, rank


def prompt_logprobs(
    hidden: jax.Array, target_ids: jax.Array, logits_fn, k: int, as_logits: bool = False
):
    """`topk_and_target` over every scheduled position of f32[T, D] hidden states, a chunk of
    positions at a time; `logits_fn` maps f32[C, D] to f32[C, V]."""
    num_tokens = hidden.shape[0]
    chunk = min(num_tokens, PROMPT_LOGPROBS_CHUNK)
    num_chunks = -(-num_tokens // chunk)
    pad = num_chunks * chunk - num_tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    target_ids = jnp.pad(target_ids, (0, pad), constant_values=-1)

    def one_chunk(args):
        h, t = args
        return topk_and_target(logits_fn(h), t, k, as_logits)

    outs = jax.lax.map(
        one_chunk,
        (hidden.reshape(num_chunks, chunk, -1), target_ids.reshape(num_chunks, chunk)),
    )
    return tuple(o.reshape(num_chunks * chunk, *o.shape[2:])[:num_tokens] for o in outs)
