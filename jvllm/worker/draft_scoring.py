"""Speculative decoding on the device: the target model's greedy token at each position that
verifies a draft, and the host's reading of them (core/spec_decode.py accepts).

A request with drafts d1..dk computes [last token, d1..dk] as one query of k + 1 tokens. The
sampler already gives the token after dk (the bonus, from the request's last position); this
scores the k positions before it, for t0..t(k-1). Only those rows go through the LM head:
at most min(T, S * k) of them a step, never the step's [T, V].
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.core.spec_decode import accept_drafts
from jvllm.sample.sampler import argmax
from jvllm.worker.buckets import Bucket


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftScoring:
    indices: jax.Array  # i32[NP] flat index (into the step's T tokens) of each scored position
    any_drafts: jax.Array  # bool[] some request has drafts: else nothing is scored


def num_scored_positions(bucket: Bucket, num_speculative_tokens: int) -> int:
    """NP of a bucket: every draft-verifying position the step can hold, one per draft."""
    return min(bucket.num_tokens, bucket.num_seqs * num_speculative_tokens)


def prepare_draft_scoring(
    query_start_loc: np.ndarray,
    draft_token_ids: list[list[int]],
    bucket: Bucket,
    num_speculative_tokens: int,
) -> DraftScoring:
    """The positions to score: of request s with k drafts, the first k of its query (its last
    token's and its drafts' but the last), in request order; padding scores token 0."""
    indices = np.zeros(num_scored_positions(bucket, num_speculative_tokens), np.int32)
    at = 0
    for start, drafts in zip(query_start_loc.tolist(), draft_token_ids):
        indices[at : at + len(drafts)] = np.arange(start, start + len(drafts))
        at += len(drafts)
    return DraftScoring(indices, np.bool_(at > 0))


def score_drafts(
    hidden: jax.Array, drafts: DraftScoring, logits_fn, branch_free: bool = False
) -> jax.Array:
    """i32[NP]: the target's greedy token after each scored position of `hidden` f32[T, D];
    `logits_fn(h f32[NP, D]) -> f32[NP, V]` is the model's LM head. The argmax is the sampler's
    (first maximum), so that a verified run equals one-token greedy steps. A step without
    drafts skips the LM head (a `lax.cond`), unless `branch_free`."""
    score = lambda: argmax(logits_fn(hidden[drafts.indices]))  # [NP, V] -> [NP]
    if branch_free:
        return score()
    num_positions = drafts.indices.shape[0]
    return jax.lax.cond(drafts.any_drafts, score, lambda: jnp.zeros(num_positions, jnp.int32))


def accepted_token_ids(
    sampled: np.ndarray, targets: np.ndarray, draft_token_ids: list[list[int]]
) -> list[list[int]]:
    """Each request's tokens from a step with drafts: `sampled` i32[R] the sampler's token (the
    bonus for a request with drafts), `targets` i32[NP] the scored positions' tokens in
    prepare_draft_scoring's order."""
    tokens, at = [], 0
    for bonus, drafts in zip(sampled.tolist(), draft_token_ids):
        scored = targets[at : at + len(drafts)].tolist()
        at += len(drafts)
        tokens.append(accept_drafts(drafts, [*scored, bonus]))
    return tokens
