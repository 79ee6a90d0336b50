"""On-device sampling: logit processors, penalties, greedy / temperature / top-k / top-p / min-p
with per-request seeds, and logprobs. Each optional stage sits behind a batch-level `lax.cond`,
so a step whose requests ask for none of it pays only for the switch; or a sampler plan fixes
the stages when the step compiles (sample/plan.py)."""

import jax
import jax.numpy as jnp

from jvllm.sample.filters import apply_top_k_top_p_min_p
from jvllm.sample.logprobs import prompt_logprobs, topk_and_target
from jvllm.sample.metadata import SamplerOutput, SamplingMetadata
from jvllm.sample.penalties import apply_penalties, token_counts
from jvllm.sample.plan import SamplerPlan
from jvllm.sampling_params import GREEDY_TEMPERATURE


def request_keys(seeds: jax.Array, output_index: jax.Array) -> jax.Array:
    """The key of a request's k-th output token: independent of the rest of the batch."""
    return jax.vmap(lambda s, k: jax.random.fold_in(jax.random.PRNGKey(s), k))(seeds, output_index)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis of f32[S, V] -> i32[S] (the first maximum), as a max and a
    min over indices: XLA:CPU's paired value/index reduction takes twice as long (5.2 against
    2.7 ms for 64 x 49152). A row without a maximum (NaN) gives its last index."""
    vocab = x.shape[-1]
    is_max = x == x.max(axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)


# Tokens per block of the two-level inverse-CDF search in `inverse_cdf`.
_CDF_BLOCK = 128


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """The token i32[S] at which u f32[S] in [0, 1) falls in each row's running sum of
    weights f32[S, V] >= 0 (unnormalised, at least one positive per row).

    Two levels, block sums and then the chosen block, so that no running sum is longer than
    V / 128. The chosen token always has a positive weight: the first one whose running sum
    exceeds the target has added to it, and rounding that leaves the block's end short of the
    target falls back on the block's last positive weight.
    """
    num_seqs, vocab = weights.shape
    num_blocks = -(-vocab // _CDF_BLOCK)
    padded = jnp.pad(weights, ((0, 0), (0, num_blocks * _CDF_BLOCK - vocab)))
    blocks = padded.reshape(num_seqs, num_blocks, _CDF_BLOCK)  # [S, NB, C]
    block_ends = jnp.cumsum(blocks.sum(-1), axis=-1)  # [S, NB]
    target = u * block_ends[:, -1]  # [S]
    block = jnp.minimum(jnp.sum(block_ends <= target[:, None], axis=-1), num_blocks - 1)
    before = jnp.take_along_axis(block_ends, jnp.maximum(block - 1, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(block > 0, before, 0.0)  # [S] weight of the blocks before
    chosen = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [S, C]
    ends = before[:, None] + jnp.cumsum(chosen, axis=-1)  # [S, C]
    offset = jnp.sum(ends <= target[:, None], axis=-1)
    last_positive = jnp.max(jnp.where(chosen > 0, jnp.arange(_CDF_BLOCK), -1), axis=-1)
    return block * _CDF_BLOCK + jnp.minimum(offset, last_positive)


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    plan: SamplerPlan = SamplerPlan.DYNAMIC,
    scaled: jax.Array | None = None,
) -> jax.Array:
    """Sample i32[S] token ids from f32[S, V] (processed) logits; `scaled`: their
    `scaled_and_filtered`, where the caller has it already."""
    greedy = argmax(logits)
    if plan is SamplerPlan.GREEDY:
        return greedy

    def random_sample() -> jax.Array:
        is_greedy = md.temperature < GREEDY_TEMPERATURE
        drawn_from = scaled_and_filtered(logits, md, plan) if scaled is None else scaled
        # One uniform per row and an inverse-CDF search: Gumbel noise for every vocabulary
        # entry cost 31 ms for 64 x 49152 logits, this 1.6 ms.
        u = jax.vmap(lambda key: jax.random.uniform(key))(request_keys(md.seeds, md.output_index))
        weights = jnp.exp(drawn_from - drawn_from.max(axis=-1, keepdims=True))  # [S, V]
        return jnp.where(is_greedy, greedy, inverse_cdf(weights, u))

    if plan is SamplerPlan.DYNAMIC:
        return jax.lax.cond(md.all_greedy, lambda: greedy, random_sample)
    return random_sample()


def scaled_and_filtered(
    logits: jax.Array, md: SamplingMetadata, plan: SamplerPlan = SamplerPlan.DYNAMIC
) -> jax.Array:
    """f32[S, V] logits over each row's temperature (greedy rows' left as they are), then
    top-k / top-p / min-p: what a random row draws from."""
    is_greedy = md.temperature < GREEDY_TEMPERATURE
    scaled = logits / jnp.where(is_greedy, 1.0, md.temperature)[:, None]
    if plan is SamplerPlan.DYNAMIC:
        return jax.lax.cond(
            md.any_filter, lambda x: apply_top_k_top_p_min_p(x, md), lambda x: x, scaled
        )
    if plan is SamplerPlan.FILTERED:
        return apply_top_k_top_p_min_p(scaled, md, branch_free=True)
    return scaled


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf on the tokens whose bit is 0 in `bitmask: i32[S, W]` (token v at bit v % 32 of word
    v // 32), for logits f32[S, V]; ids past 32 W are masked too."""
    num_seqs, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(num_seqs, -1)[:, :vocab].astype(bool)
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    return jnp.where(allowed, logits, -jnp.inf)


def process_logits(
    logits: jax.Array,
    md: SamplingMetadata,
    bias_rows: jax.Array,
    token_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
) -> jax.Array:
    """vLLM's order: the grammar masks of structured outputs, the other logit processors (bias,
    allowed ids, bad words, min_tokens: one additive row per request in `bias_rows: f32[R, V]`),
    then penalties."""
    logits = jax.lax.cond(
        md.any_constrained,
        lambda x: apply_token_bitmask(x, md.token_bitmask),
        lambda x: x,
        logits,
    )
    logits = jax.lax.cond(md.any_bias, lambda x: x + bias_rows[md.bias_slot], lambda x: x, logits)

    def penalize(x):
        counts, prompt_mask = token_counts(
            token_cache, block_tables, seq_lens, md.num_prompt_tokens, x.shape[-1]
        )
        return apply_penalties(
            x,
            counts,
            prompt_mask,
            md.presence_penalty,
            md.frequency_penalty,
            md.repetition_penalty,
        )

    return jax.lax.cond(md.any_penalties, penalize, lambda x: x, logits)


def _no_logprobs(num_rows: int, k: int) -> tuple[jax.Array, ...]:
    return (
        jnp.zeros((num_rows, k), jnp.int32),
        jnp.zeros((num_rows, k), jnp.float32),
        jnp.zeros(num_rows, jnp.float32),
        jnp.zeros(num_rows, jnp.int32),
    )


def sample_tokens(
    logits: jax.Array,
    md: SamplingMetadata,
    *,
    bias_rows: jax.Array,
    token_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    max_logprobs: int,
    logprobs_mode: str = "raw_logprobs",
    plan: SamplerPlan = SamplerPlan.DYNAMIC,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Each row's next token from its f32[S, V] raw logits, as a request decoding one token
    at a time gets it: logit processors, penalties over the row's `seq_lens` tokens of its
    `block_tables` row, then `sample`'s draw with the key of the row's output index ->
    (i32[S] tokens, their logprobs: top ids i32[S, K], top logprobs f32[S, K], the token's
    logprob f32[S] and rank i32[S], zeros unless `md.any_logprobs`). A row depends on its own
    inputs alone: the decoding rows and speculative decoding's draft positions
    (worker/draft_scoring.py) both sample here. A plan other than DYNAMIC is only for steps
    that `choose_plan` gives it: no processors, penalties or logprobs.

    `logprobs_mode` (config.LOGPROBS_MODES): the logprobs of the raw logits or of the
    processed ones a row draws from, or those logits themselves."""
    k = max(max_logprobs, 1)
    if plan is not SamplerPlan.DYNAMIC:
        return sample(logits, md, plan), _no_logprobs(logits.shape[0], k)
    processed = process_logits(logits, md, bias_rows, token_cache, block_tables, seq_lens)
    # The processed modes' values are of what a row draws from: made once, for both.
    drawn_from = None
    if logprobs_mode.startswith("processed"):
        drawn_from = scaled_and_filtered(processed, md)
    sampled = sample(processed, md, scaled=drawn_from)

    def sampled_logprobs():
        source = logits if drawn_from is None else drawn_from
        return topk_and_target(source, sampled, k, logprobs_mode.endswith("_logits"))

    top = jax.lax.cond(md.any_logprobs, sampled_logprobs, lambda: _no_logprobs(logits.shape[0], k))
    return sampled, top


def sample_step(
    logits: jax.Array,
    hidden: jax.Array,
    md: SamplingMetadata,
    *,
    bias_rows: jax.Array,
    token_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    logits_fn,
    max_logprobs: int,
    logprobs_mode: str = "raw_logprobs",
    plan: SamplerPlan = SamplerPlan.DYNAMIC,
) -> SamplerOutput:
    """Everything after the forward: f32[S, V] last-position logits and f32[T, D] hidden states
    (for prompt logprobs, through `logits_fn`) -> `SamplerOutput`; `sample_tokens` samples.
    A prompt's positions are sampled by nothing, so their logprobs are of the raw logits in
    every `logprobs_mode`."""
    sampled, top = sample_tokens(
        logits,
        md,
        bias_rows=bias_rows,
        token_cache=token_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        max_logprobs=max_logprobs,
        logprobs_mode=logprobs_mode,
        plan=plan,
    )
    num_tokens, k = hidden.shape[0], max(max_logprobs, 1)
    if plan is not SamplerPlan.DYNAMIC:
        return SamplerOutput(sampled, *top, *_no_logprobs(num_tokens, k))
    as_logits = logprobs_mode.endswith("_logits")
    prompt = jax.lax.cond(
        md.any_prompt_logprobs,
        lambda: prompt_logprobs(hidden, md.prompt_target_ids, logits_fn, k, as_logits),
        lambda: _no_logprobs(num_tokens, k),
    )
    return SamplerOutput(sampled, *top, *prompt)
