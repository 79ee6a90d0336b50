"""Speculative decoding's draft heads on the device: an EAGLE-3 head ("eagle3",
models/eagle3.py) drafting from the rows entering three of the target's layers, or a
DeepSeek-V3 MTP layer ("mtp", models/deepseek_mtp.py) drafting from the target's final hidden
states. Both are one decoder layer over (the next token's embedding, a hidden row), so one
machinery runs them; `DraftHead` binds either's computations.

The head's KV cache is its own one layer, [1, V, K_h, P, B, H_h] (MLA's latent rows for an MTP
layer), over the target's page ids (as a draft model's: worker/draft_model.py). Its row at
position j is computed from the target's rows at j and the embedding of the token AT j + 1, so
inside the target's step (step_fn.model_step), once the step has sampled, `head_in_step` runs
the head over every position of the step: the next token of a position is the one scheduled
after it, the step's sample at a sequence's last position (or the prompt's next token, for a
chunk short of its prompt's end), and at a position that verifies a draft the target's token
there (a rejected draft's successors are recomputed by the steps that compute them). The
head's output at each sequence's last kept position (after the drafts it accepted) is the first
draft, and its pre-norm row is what the next draft step reads in place of the target's rows:
the step hands both out (`HeadState`). After the step, `propose_eagle` runs the head k - 1 more
decode steps from there for the requests that decode next, one jitted call for all of them.

Every draft is the head's argmax, deterministic, so the verification keeps the target's
distribution exactly (worker/draft_scoring.py), greedy and seeded alike.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.model import module_method, token_embeddings
from jvllm.models.registry import model_class
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.step_inputs import StepInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    """What a step leaves the proposal after it, one row per sequence of the step."""

    first_drafts: jax.Array  # i32[S] the head's token after the sequence's last kept one
    hidden: jax.Array  # f32[S, D_h] the head's pre-norm row at that position


@dataclasses.dataclass(frozen=True)
class DraftHead:
    """A draft head's computations, its config and its target's bound."""

    # The target layers whose inputs it reads (EAGLE-3), or None: the target's final hidden
    # states (the forward's output rows, an MTP layer's).
    layer_ids: tuple[int, ...] | None
    target_hidden_size: int  # D_t
    # embed(target params, token_ids i32[T]) -> f32[T, D] rows of the target's table
    embed: Callable
    # combine(head params, rows f32[3, T, D_t] or f32[T, D_t] as layer_ids says) -> f32[T, D_h]
    combine: Callable
    # forward(head params, kv, embeds, hidden, positions, metadata) -> (normed, prenorm, kv)
    forward: Callable
    # draft_tokens(head params, normed f32[S, D_h]) -> i32[S] target token ids
    draft_tokens: Callable


def draft_head(head: ModelConfig, target: ModelConfig, attn) -> DraftHead:
    def call(method: str, *last):
        return lambda params, *args: module_method(params, method, *args, *last, config=head)

    return DraftHead(
        model_class(head.architecture).target_layer_ids(head, target),
        target.hidden_size,
        functools.partial(token_embeddings, config=target),
        call("combine"),
        call("__call__", attn),
        call("draft_tokens"),
    )


def last_kept_and_next_tokens(inputs: StepInputs, sampled, targets):
    """(i32[S] the flat index of each sequence's last kept position: its last scheduled one,
    less the drafts it rejected; i32[T] the token after each position, as the module docstring
    says). `sampled` i32[S] the step's samples, `targets` i32[NP] the target's tokens at the
    scored positions (draft_scoring.py)."""
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


def head_in_step(
    head: DraftHead,
    target_params,
    head_params,
    head_kv,
    inputs: StepInputs,
    target_rows: jax.Array,
    sampled: jax.Array,
    targets: jax.Array,
):
    """The head over a step's positions (module docstring), `target_rows` the target's rows
    the head reads (f32[3, T, D_t] entering its layers `head.layer_ids`, or its final hidden
    states f32[T, D_t]) -> (head_kv, HeadState)."""
    last_kept, next_tokens = last_kept_and_next_tokens(inputs, sampled, targets)
    embeds = head.embed(target_params, next_tokens)  # [T, D]
    hidden = head.combine(head_params, target_rows)  # [T, D_h]
    normed, prenorm, head_kv = head.forward(
        head_params, head_kv, embeds, hidden, inputs.positions, inputs.attn
    )
    first = head.draft_tokens(head_params, normed[last_kept])  # [S]
    return head_kv, HeadState(first, prenorm[last_kept].astype(jnp.float32))


def propose_eagle(
    params,
    head_kv,
    inputs: StepInputs,
    num_steps_per_row,
    state: HeadState,
    rows,
    *,
    head: DraftHead,
    num_steps: int,
    block_size: int,
):
    """k = `num_steps` drafts a row: its first from the step before (`state`, row `rows[s]`
    i32[S] of it), then k - 1 head decode steps from `inputs` (a decode bucket at each row's
    position p, the one after its last kept), writing the head's KV at p..; row s runs
    `num_steps_per_row[s]` i32[S] of them (0..k-1), its drafts past that meaningless
    -> (drafts i32[S, k], head_kv)."""
    target_params, head_params = params
    tokens, hidden = state.first_drafts[rows], state.hidden[rows]  # [S], [S, D_h]
    active = num_steps_per_row > 0
    md = dataclasses.replace(
        inputs.attn, slot_mapping=jnp.where(active, inputs.attn.slot_mapping, 0)
    )
    inputs = dataclasses.replace(inputs, token_ids=tokens, attn=md)
    drafts = jnp.zeros((tokens.shape[0], num_steps), jnp.int32).at[:, 0].set(tokens)

    def body(i, carry):
        # Through a barrier with the carry: decode_loop.decode_step says why.
        params_i, (kv, step_inputs, hidden, drafts) = jax.lax.optimization_barrier(
            ((target_params, head_params), carry)
        )
        embeds = head.embed(params_i[0], step_inputs.token_ids)
        normed, prenorm, kv = head.forward(
            params_i[1], kv, embeds, hidden, step_inputs.positions, step_inputs.attn
        )
        token_ids = head.draft_tokens(params_i[1], normed)  # [S]
        drafts = drafts.at[:, i + 1].set(token_ids)
        step_inputs = advance_inputs(step_inputs, token_ids, i + 1 < num_steps_per_row, block_size)
        return kv, step_inputs, prenorm.astype(jnp.float32), drafts

    head_kv, _, _, drafts = jax.lax.fori_loop(
        0, num_steps - 1, body, (head_kv, inputs, hidden, drafts)
    )
    return drafts, head_kv
