"""Speculative decoding's draft heads on the device: an EAGLE-3 head ("eagle3",
models/eagle3.py) drafting from the rows entering three of the target's layers, an EAGLE-1 head
("eagle", models/eagle1.py) or a DeepSeek-V3 MTP layer ("mtp", models/deepseek_mtp.py) drafting
from the target's final hidden states. Each is one decoder layer over (the next token's
embedding, a hidden row), so one machinery runs them; `DraftHead` binds one's computations.

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
the same call then runs the head k - 1 decode steps from there for the sequences that sampled,
each reading the head's own previous row, and the step hands out every sequence's k drafts. A
round (verify, then propose) is one device call and one wait on the host.

Every draft is a greedy row's argmax of the head's logits, or a sampled row's draw from them
with the uniform the target's sampler will draw that output index with
(draft_positions.choose_drafts): deterministic given the request's seed, so the verification
keeps the target's tokens exactly (worker/draft_scoring.py), greedy and seeded alike.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.layers.parallel import gather_over_shards
from jvllm.models.model import compute_logits, module_method, token_embeddings
from jvllm.models.registry import model_class
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.draft_positions import (
    decode_after,
    draft_history,
    first_draft_index,
    in_table,
    last_kept_and_next_tokens,
)
from jvllm.worker.step_inputs import StepInputs


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
    # draft_logits((target params, head params), normed f32[S, D_h]) -> f32[S, V] over the
    # target's vocabulary (an EAGLE-3 head's draft vocabulary placed at its target ids)
    draft_logits: Callable
    num_drafts: int  # k, the drafts a sequence gets each step


def draft_head(
    head: ModelConfig,
    target: ModelConfig,
    attn,
    num_drafts: int,
    vocab_size: int | None = None,
) -> DraftHead:
    """`head` drafting for `target` (both one device's shard inside a group's shard_map,
    distributed/data_parallel_moe.rank_config: then `vocab_size` is the target's whole
    vocabulary, which the head's logits are gathered to)."""
    vocab_size = vocab_size or target.vocab_size

    def call(method: str, *last):
        return lambda params, *args: module_method(params, method, *args, *last, config=head)

    family = model_class(head.architecture)
    if getattr(family, "uses_target_lm_head", False):  # EAGLE-1: the target's LM head reads it
        logits = functools.partial(compute_logits, config=target)
        draft_logits = lambda params, rows: gather_over_shards(
            logits(params[0], rows), target.num_shards, axis=1
        )[:, :vocab_size]
    else:
        own = call("draft_logits", vocab_size)
        draft_logits = lambda params, rows: own(params[1], rows)
    return DraftHead(
        family.target_layer_ids(head, target),
        target.hidden_size,
        functools.partial(token_embeddings, config=target),
        call("combine"),
        call("__call__", attn),
        draft_logits,
        num_drafts,
    )


def head_in_step(
    head: DraftHead,
    target_params,
    head_params,
    head_kv,
    inputs: StepInputs,
    target_rows: jax.Array,
    sampled: jax.Array,
    targets: jax.Array,
    token_cache: jax.Array,
    block_size: int,
    choose: Callable,
):
    """The head over a step's positions, then k - 1 decode steps (module docstring);
    `target_rows` the target's rows the head reads (f32[3, T, D_t] entering its layers
    `head.layer_ids`, or its final hidden states f32[T, D_t]) -> (head_kv, drafts i32[S, k]:
    sequence s's, meaningful where it sampled and its blocks hold the positions they were
    computed at, p..p+k-2 after its last kept one; elsewhere they write the null page)."""
    last_kept, next_tokens = last_kept_and_next_tokens(inputs, sampled, targets)
    choose = functools.partial(
        choose, history=draft_history(token_cache, inputs, last_kept, next_tokens)
    )
    embeds = head.embed(target_params, next_tokens)  # [T, D]
    hidden = head.combine(head_params, target_rows)  # [T, D_h]
    normed, prenorm, head_kv = head.forward(
        head_params, head_kv, embeds, hidden, inputs.positions, inputs.attn
    )
    first_index = first_draft_index(inputs, last_kept)  # [S]
    logits = head.draft_logits((target_params, head_params), normed[last_kept])  # [S, V]
    drafts = jnp.zeros((logits.shape[0], head.num_drafts), jnp.int32)
    tokens = choose(logits, inputs.sampling, first_index, drafts, 0)  # [S] firsts
    step_inputs = decode_after(inputs, last_kept, tokens, block_size)
    active = step_inputs.attn.seq_lens > 0  # [S] the sequences that sampled
    drafts = drafts.at[:, 0].set(tokens)

    def body(i, carry):
        # Through a barrier with the carry: decode_loop.decode_step says why.
        params_i, (kv, step_inputs, hidden, drafts) = jax.lax.optimization_barrier(
            ((target_params, head_params), carry)
        )
        embeds = head.embed(params_i[0], step_inputs.token_ids)
        normed, prenorm, kv = head.forward(
            params_i[1], kv, embeds, hidden, step_inputs.positions, step_inputs.attn
        )
        logits = head.draft_logits(params_i, normed)  # [S, V]
        token_ids = choose(logits, step_inputs.sampling, first_index + i + 1, drafts, i + 1)
        drafts = drafts.at[:, i + 1].set(token_ids)
        tables = step_inputs.attn.block_tables
        next_active = active & in_table(step_inputs.positions + 1, tables, block_size)
        step_inputs = advance_inputs(step_inputs, token_ids, next_active, block_size)
        return kv, step_inputs, prenorm.astype(jnp.float32), drafts

    carry = (head_kv, step_inputs, prenorm[last_kept].astype(jnp.float32), drafts)
    head_kv, _, _, drafts = jax.lax.fori_loop(0, head.num_drafts - 1, body, carry)
    return head_kv, drafts
