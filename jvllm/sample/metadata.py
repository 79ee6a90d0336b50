"""Per-request sampling parameters as arrays, one row per sequence of the step."""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    seeds: jax.Array  # u32[S] each request's seed
    # i32[S] the output index of the token the row samples (its key's): how many tokens the
    # request has output so far, plus its drafts when it has some (speculative decoding).
    output_index: jax.Array
    presence_penalty: jax.Array  # f32[S]; 0 = off
    frequency_penalty: jax.Array  # f32[S]; 0 = off
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    num_prompt_tokens: jax.Array  # i32[S] positions at or past this are outputs (penalties)
    bias_slot: jax.Array  # i32[S] row of the engine's logit-bias table; 0 = the zero row
    prompt_target_ids: jax.Array  # i32[T] the prompt token each position predicts; -1 = none
    # Packed allowed-token bits of each row's grammar, token v at bit v % 32 of word v // 32:
    # i32[S, ceil(V / 32)], all ones (-1) for a row without structured outputs.
    token_bitmask: jax.Array
    # Batch-level switches: a step whose requests ask for none of it skips the work (lax.cond).
    all_greedy: jax.Array  # bool[] every row is greedy: skip the sort and the noise
    any_filter: jax.Array  # bool[] some row uses top-k, top-p or min-p: sort the vocabulary
    any_penalties: jax.Array  # bool[]
    any_bias: jax.Array  # bool[]
    any_constrained: jax.Array  # bool[] some row's grammar masks its logits
    any_logprobs: jax.Array  # bool[]
    any_prompt_logprobs: jax.Array  # bool[]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What one step returns besides the KV cache. K = the engine's max_logprobs (at least 1);
    the logprob fields are zeros in steps where no request asked for them."""

    sampled_token_ids: jax.Array  # i32[S]
    topk_token_ids: jax.Array  # i32[S, K] raw-logprob top-k of each sequence's next token
    topk_logprobs: jax.Array  # f32[S, K]
    sampled_logprobs: jax.Array  # f32[S]
    sampled_ranks: jax.Array  # i32[S] 1 = the most likely token
    prompt_topk_token_ids: jax.Array  # i32[T, K] per scheduled token: top-k of the next position
    prompt_topk_logprobs: jax.Array  # f32[T, K]
    prompt_target_logprobs: jax.Array  # f32[T] logprob of prompt_target_ids
    prompt_target_ranks: jax.Array  # i32[T]
    # Speculative decoding: the target's token after each draft-verifying position
    # (worker/draft_scoring.py), i32[NP], and its logprobs as the four sampled_* / topk_*
    # fields ([NP, K], [NP, K], [NP], [NP]); None (no output) when speculation is off.
    draft_target_ids: jax.Array | None = None
    draft_logprobs: tuple[jax.Array, ...] | None = None


# The fields with one row per sequence: what a row of another sequence's samples takes.
_PER_SEQUENCE_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seeds",
    "output_index",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "num_prompt_tokens",
    "bias_slot",
    "token_bitmask",
)


def take_rows(
    md: SamplingMetadata, seq_index: jax.Array, num_tokens_before: jax.Array
) -> SamplingMetadata:
    """Metadata of rows that sample for sequences `seq_index` i32[R], each `num_tokens_before`
    i32[R] output tokens before the sequence's own row (speculative decoding's draft
    positions); the batch-level switches stay the step's."""
    rows = {name: getattr(md, name)[seq_index] for name in _PER_SEQUENCE_FIELDS}
    rows["output_index"] = rows["output_index"] - num_tokens_before
    return dataclasses.replace(md, **rows)
