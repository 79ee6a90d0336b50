"""Speculative decoding on the device: the target model's token at each position that verifies
a draft, and the host's reading of them (core/spec_decode.py accepts).

A request with drafts d1..dk computes [last token, d1..dk] as one query of k + 1 tokens. The
sampler already gives the token after dk (the bonus, from the request's last position, at
output index o + k); this samples the k positions before it, for t0..t(k-1): position i as the
sampler samples output index o + i when decoding one token at a time (`sample_tokens`: the
same processors, filters and seeded key; penalties count the tokens up to position i, drafts
included, from the token cache the step has written). So every accepted token is what plain
decoding would have drawn, and a seeded request's text does not change with speculation; a
greedy request's is the argmax. Only those rows go through the LM head: at most min(T, S * k)
of them a step, never the step's [T, V].
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.core.spec_decode import accept_drafts
from jvllm.sample.metadata import SamplingMetadata, take_rows
from jvllm.worker.buckets import Bucket
from jvllm.worker.runner_output import ModelRunnerOutput


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftScoring:
    indices: jax.Array  # i32[NP] flat index (into the step's T tokens) of each scored position
    seq_index: jax.Array  # i32[NP] its request's row among the step's sequences
    num_tokens_before: jax.Array  # i32[NP] output tokens between it and its request's bonus
    token_bitmask: jax.Array  # i32[NP, W] its grammar mask (structured outputs); -1: none
    any_drafts: jax.Array  # bool[] some request has drafts: else nothing is scored
    # i32[S] each sequence's token after its last scheduled one where the step does not sample
    # it (a prompt chunk short of the prompt's end), -1 where it does: a draft head's input
    # (worker/eagle.py)
    next_token_ids: jax.Array


def num_scored_positions(bucket: Bucket, num_speculative_tokens: int) -> int:
    """NP of a bucket: every draft-verifying position the step can hold, one per draft."""
    return min(bucket.num_tokens, bucket.num_seqs * num_speculative_tokens)


def prepare_draft_scoring(
    query_start_loc: np.ndarray,
    draft_token_ids: list[list[int]],
    bucket: Bucket,
    num_speculative_tokens: int,
    num_words: int,
    token_bitmask: np.ndarray | None = None,
    next_token_ids: list[int] | None = None,
) -> DraftScoring:
    """The positions to score: of request s with k drafts, the first k of its query (its last
    token's and its drafts' but the last), in request order; padding scores token 0.
    `token_bitmask` i32[num drafts, W]: their grammar masks in that order (W = `num_words`),
    None for none. `next_token_ids`: each request's DraftScoring.next_token_ids (None: all
    -1)."""
    num_positions = num_scored_positions(bucket, num_speculative_tokens)
    indices = np.zeros(num_positions, np.int32)
    seq_index = np.zeros(num_positions, np.int32)
    num_tokens_before = np.zeros(num_positions, np.int32)
    at = 0
    for s, (start, drafts) in enumerate(zip(query_start_loc.tolist(), draft_token_ids)):
        k = len(drafts)
        indices[at : at + k] = np.arange(start, start + k)
        seq_index[at : at + k] = s
        num_tokens_before[at : at + k] = np.arange(k, 0, -1)
        at += k
    if token_bitmask is None:
        bitmask = _all_tokens_allowed(num_positions, num_words)
    else:
        bitmask = np.full((num_positions, num_words), -1, np.int32)
        bitmask[: len(token_bitmask)] = token_bitmask
    next_ids = np.full(bucket.num_seqs, -1, np.int32)
    if next_token_ids:
        next_ids[: len(next_token_ids)] = next_token_ids
    return DraftScoring(indices, seq_index, num_tokens_before, bitmask, np.bool_(at > 0), next_ids)


@functools.cache
def _all_tokens_allowed(num_positions: int, num_words: int) -> np.ndarray:
    """The draft masks of a step without structured outputs: one array a shape, never written."""
    mask = np.full((num_positions, num_words), -1, np.int32)
    mask.flags.writeable = False
    return mask


def score_drafts(
    hidden: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    md: SamplingMetadata,
    drafts: DraftScoring,
    logits_fn,
    sample_fn,
    branch_free: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The target's token i32[NP] after each scored position of `hidden` f32[T, D] (at
    `positions` i32[T]), and its logprobs; `logits_fn(h f32[NP, D]) -> f32[NP, V]` is the
    model's LM head, `sample_fn(logits, md, *, block_tables, seq_lens)` the step's
    `sample_tokens`, its other arguments bound; each row samples under its own grammar mask
    (`drafts.token_bitmask`). A step without drafts skips all of it (a `lax.cond`), unless
    `branch_free`."""

    def score():
        logits = logits_fn(hidden[drafts.indices])  # [NP, V]
        rows = take_rows(md, drafts.seq_index, drafts.num_tokens_before)
        rows = dataclasses.replace(rows, token_bitmask=drafts.token_bitmask)
        seq_lens = positions[drafts.indices] + 1  # each row's history: up to its position
        return sample_fn(
            logits, rows, block_tables=block_tables[drafts.seq_index], seq_lens=seq_lens
        )

    if branch_free:
        return score()
    nothing = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(score))
    return jax.lax.cond(drafts.any_drafts, score, lambda: nothing)


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


def run_logprobs(
    sampled: tuple[np.ndarray, ...],
    scored: tuple[np.ndarray, ...],
    draft_token_ids: list[list[int]],
) -> tuple[np.ndarray, ...]:
    """The logprobs of each request's tokens from a step with drafts, shaped as a decode
    window's ([k + 1, R, ...]: token j of request r at [j, r]): its scored positions' rows
    (`scored`, [NP, ...] in prepare_draft_scoring's order) while j < its drafts, then its
    sampled row (`sampled`, [R, ...], the bonus)."""
    num_steps = 1 + max(len(drafts) for drafts in draft_token_ids)
    runs = []
    for rows, scored_rows in zip(sampled, scored):
        run = np.repeat(rows[None], num_steps, axis=0)
        at = 0
        for r, drafts in enumerate(draft_token_ids):
            run[: len(drafts), r] = scored_rows[at : at + len(drafts)]
            at += len(drafts)
        runs.append(run)
    return tuple(runs)


def with_accepted_runs(
    result: ModelRunnerOutput, out, draft_token_ids: list[list[int]]
) -> ModelRunnerOutput:
    """`result`, fetched from a step with drafts whose device outputs are `out`, with each
    request's accepted run of tokens as a list, and their logprobs where it holds any."""
    targets = np.asarray(out.draft_target_ids)
    tokens = accepted_token_ids(result.sampled_token_ids, targets, draft_token_ids)
    logprobs = result.logprobs
    if logprobs is not None:  # a window's shape: a row per token of a run
        scored = tuple(np.asarray(a) for a in out.draft_logprobs)
        logprobs = run_logprobs(logprobs, scored, draft_token_ids)
    return dataclasses.replace(result, sampled_token_ids=tokens, logprobs=logprobs)
