"""Where a step's drafts go on from, on the device: each sequence's last kept position (its last
scheduled one, less the drafts the step rejected), the token after each position of the step,
a decode step's inputs at the position after the last kept one, and the drafts' output
indices and tokens. A draft head (worker/eagle.py) and a draft model (worker/draft_model.py)
propose from there inside the target's step."""

import dataclasses

import jax
import jax.numpy as jnp

from jvllm.attention.metadata import AttentionMetadata, Tiles
from jvllm.sample.metadata import SamplingMetadata
from jvllm.sample.penalties import apply_penalties, token_counts
from jvllm.sample.plan import SamplerPlan
from jvllm.sample.sampler import sample
from jvllm.worker.step_inputs import StepInputs


def last_kept_and_next_tokens(inputs: StepInputs, sampled, targets):
    """(i32[S] the flat index of each sequence's last kept position: its last scheduled one,
    less the drafts it rejected; i32[T] the token after each position: the one scheduled after
    it, the step's sample at a sequence's last position (or the prompt's next token, for a chunk
    short of its prompt's end), and at a position that verifies a draft the target's token
    there). `sampled` i32[S] the step's samples, `targets` i32[NP] the target's tokens at the
    scored positions (draft_scoring.py). After the first rejected draft of a run the tokens are
    the rejected ones', which the steps that compute those positions write again."""
    md, drafts = inputs.attn, inputs.drafts
    num_tokens, num_seqs = inputs.token_ids.shape[0], md.seq_lens.shape[0]
    scored = drafts.num_tokens_before > 0  # [NP] real entries (padding: 0)
    seq = drafts.seq_index
    agrees = inputs.token_ids[jnp.minimum(drafts.indices + 1, num_tokens - 1)] == targets
    offset = drafts.indices - md.query_start_loc[seq]  # the draft's place in its run, 0..k-1
    num_drafts = jax.ops.segment_sum(scored.astype(jnp.int32), seq, num_seqs)  # [S]
    first_miss = jax.ops.segment_min(jnp.where(scored & ~agrees, offset, num_tokens), seq, num_seqs)
    accepted = jnp.minimum(first_miss, num_drafts)
    last_kept = md.logits_indices - num_drafts + accepted  # [S]

    next_tokens = jnp.roll(inputs.token_ids, -1)  # [T] the next scheduled token
    ends = jnp.where(md.seq_lens > 0, md.logits_indices, num_tokens)  # padding rows: none
    after_end = jnp.where(drafts.next_token_ids >= 0, drafts.next_token_ids, sampled)
    next_tokens = next_tokens.at[ends].set(after_end, mode="drop")
    next_tokens = next_tokens.at[jnp.where(scored, drafts.indices, num_tokens)].set(
        targets, mode="drop"
    )
    return last_kept, next_tokens


def decode_after(inputs: StepInputs, last_kept, tokens, block_size: int) -> StepInputs:
    """A decode step's inputs for the sequences of a step: sequence s's `tokens[s]` at the
    position after its last kept one (`last_kept` i32[S], flat), reading and writing its pages
    where the step sampled it; the others (a prompt chunk short of its end, padding) read
    nothing and write the null page. A position past a sequence's blocks writes the null page
    too (its table's padding), and its drafts are dropped on the host; one past the table's
    last column (a sequence at max_model_len) does not run (`in_table`)."""
    md = inputs.attn
    num_seqs = md.seq_lens.shape[0]
    positions = inputs.positions[last_kept] + 1  # [S]
    sampled = (md.seq_lens > 0) & (inputs.drafts.next_token_ids < 0)  # [S]
    sampled = sampled & in_table(positions, md.block_tables, block_size)
    column = jnp.minimum(positions // block_size, md.block_tables.shape[1] - 1)
    pages = jnp.take_along_axis(md.block_tables, column[:, None], axis=1)[:, 0]
    kv_lens = jnp.where(sampled, positions + 1, 0)  # a decode reads its own new key too
    rows = jnp.arange(num_seqs, dtype=jnp.int32)
    # A tile a row, the sampled rows' first: the pure-JAX page walk reads only the leading
    # tiles that read (attention/reference.py), as the host packs them.
    order = jnp.argsort(~sampled, stable=True).astype(jnp.int32)
    attn = AttentionMetadata(
        slot_mapping=jnp.where(sampled, pages * block_size + positions % block_size, 0),
        block_tables=md.block_tables,
        seq_lens=kv_lens,
        query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32),
        logits_indices=rows,
        tiles=(Tiles(order[:, None], kv_lens[order][:, None], order),),
    )
    return StepInputs(tokens, positions, attn, inputs.sampling)


def in_table(positions: jax.Array, block_tables: jax.Array, block_size: int) -> jax.Array:
    """Whether each position i32[S] has a column in its sequence's table i32[S, M]: the draft
    loops stop a row before it would look a page up past the table (an out-of-range lookup gives
    a page id that wraps onto another sequence's slots)."""
    return positions < block_tables.shape[1] * block_size


def first_draft_index(inputs: StepInputs, last_kept: jax.Array) -> jax.Array:
    """The output index i32[S] of each sequence's first draft: the one after its last kept
    token's. The step's sample (its bonus) stands at `output_index`, past the drafts it rejected
    (its last position less `last_kept`)."""
    return inputs.sampling.output_index - (inputs.attn.logits_indices - last_kept) + 1


@dataclasses.dataclass(frozen=True)
class DraftHistory:
    """The tokens the target's penalties count at a sequence's drafts: its tokens in the token
    cache (the step's written) up to its last kept position, then the token after that
    position, then the drafts before the one drawn."""

    token_cache: jax.Array  # i32[P, B]
    block_tables: jax.Array  # i32[S, M]
    kept_lens: jax.Array  # i32[S] each sequence's tokens up to and with its last kept position
    next_tokens: jax.Array  # i32[S] the token after it

    def penalize(self, logits, sampling: SamplingMetadata, drafts, num_drawn) -> jax.Array:
        """f32[S, V] logits with the rows' penalties over their history and their first
        `num_drawn` (i32[], or an int) drafts of i32[S, k] `drafts` (vLLM's, as the target's
        sampler applies them: sample/penalties.py)."""
        counts, prompt_mask = token_counts(
            self.token_cache,
            self.block_tables,
            self.kept_lens,
            sampling.num_prompt_tokens,
            logits.shape[-1],
        )
        after = jnp.concatenate([self.next_tokens[:, None], drafts], axis=1)  # [S, 1 + k]
        rows = jnp.broadcast_to(jnp.arange(after.shape[0])[:, None], after.shape)
        drawn = jnp.arange(after.shape[1])[None] <= num_drawn  # [1, 1 + k]
        counts = counts.at[rows, after].add(jnp.broadcast_to(drawn, after.shape))
        return apply_penalties(
            logits,
            counts,
            prompt_mask,
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
        )


def draft_history(token_cache, inputs: StepInputs, last_kept, next_tokens) -> DraftHistory:
    """A step's DraftHistory from its sequences' last kept positions i32[S] (flat) and the
    token after each position i32[T] (last_kept_and_next_tokens)."""
    kept_lens = inputs.positions[last_kept] + 1
    return DraftHistory(token_cache, inputs.attn.block_tables, kept_lens, next_tokens[last_kept])


def choose_drafts(
    logits: jax.Array,
    sampling: SamplingMetadata,
    output_index: jax.Array,
    drafts: jax.Array,
    num_drawn,
    *,
    plan: SamplerPlan,
    bias_rows: jax.Array,
    history: DraftHistory,
) -> jax.Array:
    """Each sequence's draft i32[S] from the draft's logits f32[S, V] over the target's
    vocabulary, for output index `output_index` i32[S], after its first `num_drawn` drafts of
    i32[S, k] `drafts`: a greedy row's argmax; a sampled row's draw from the draft's
    distribution under the row's logit-bias row (`bias_rows` f32[R, V]: its bias, allowed and
    banned ids, as the target's), its penalties over its `history` and drafts, and its
    temperature, top-k, top-p and min-p, with the uniform the target's sampler draws that
    output index with (sample/sampler.py). The target's token there is drawn with the same
    uniform from its own distribution, so the two agree wherever the distributions are close
    (common random numbers: the target itself as its draft agrees always), and the
    verification keeps the target's sample, as ever. Grammar masks shape the target's alone
    (the draft's tokens would move the grammar's state, which the host keeps)."""
    if plan is SamplerPlan.DYNAMIC:  # other plans run steps without these (sample/plan.py)
        logits = jax.lax.cond(
            sampling.any_bias, lambda x: x + bias_rows[sampling.bias_slot], lambda x: x, logits
        )
        logits = jax.lax.cond(
            sampling.any_penalties,
            lambda x: history.penalize(x, sampling, drafts, num_drawn),
            lambda x: x,
            logits,
        )
    return sample(logits, dataclasses.replace(sampling, output_index=output_index), plan)
