"""Speculative decoding's "draft_model" method on the device (vLLM v1's DraftModelProposer).

The draft loads beside the target (same mesh, same dtype) with a KV cache of its own,
[L_d, V, K_d, P, B, H_d], over the SAME page ids: it reads the target's block tables, so it needs
no allocator, and the KV budget counts both models' bytes a block (kv_budget.py). Every step
runs the draft's forward (its KV only, no LM head) over the step's tokens inside the target's
jitted step (step_fn.model_step), so its cache holds every computed position, drafts included;
a rejected draft's position is written again by the step that computes it next.

Once the step has sampled, the same call proposes k drafts for each sequence that sampled
(`propose`): k draft decode steps from the token after its last kept position, at p,
writing the draft's KV at p..p+k-1 (the scheduler allocates those k lookahead slots:
num_lookahead_tokens), each draft a greedy row's argmax or a sampled row's draw with the
uniform the target's sampler will draw that output index with (draft_positions.choose_drafts).
Given the request's seed a draft is deterministic, so the verification
(worker/draft_scoring.py) keeps the target's tokens exactly, greedy and seeded alike.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jvllm.config import ModelConfig
from jvllm.core.engine_config import LoadConfig
from jvllm.core.request import Request
from jvllm.distributed.sharded_model import ShardedModel
from jvllm.model_loader import load_model
from jvllm.models.registry import EAGLE_HEAD_ARCHITECTURE, mtp_head_architecture
from jvllm.spec_decode.config import HEAD_METHODS, MODEL_METHODS, SpeculativeConfig
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.draft_positions import (
    decode_after,
    draft_history,
    first_draft_index,
    in_table,
    last_kept_and_next_tokens,
)
from jvllm.worker.step_inputs import StepInputs


@dataclasses.dataclass
class DraftModel:
    """A loaded draft: its config and params (on the target's mesh), and the speculative
    method it drafts for: "draft_model", or a draft head's, "eagle3" or "mtp"
    (worker/eagle.py)."""

    config: ModelConfig
    params: dict
    method: str = "draft_model"


def load_draft(
    spec: SpeculativeConfig | None,
    load: LoadConfig,
    target: ModelConfig,
    mesh: Mesh,
    enable_expert_parallel: bool,
) -> DraftModel | None:
    """speculative_config's draft model (method "draft_model"), EAGLE-3 head ("eagle3") or
    the MTP layer of a checkpoint ("mtp": by default the target's own, read as its draft
    head's architecture), on the target's `mesh` in the target's dtype (its experts placed as
    the target's), without a tokenizer: it must share the target's. None for no draft model
    (no speculation, or n-gram drafts)."""
    if spec is None or spec.method not in MODEL_METHODS:
        return None
    path, overrides = spec.model, spec.hf_overrides
    if spec.method == "mtp":
        path = load.model if path is None else path
        head = mtp_head_architecture(target.architecture)
        overrides = {**(overrides or {}), "architectures": [head]}
    elif spec.method == "eagle":  # its checkpoints name themselves LlamaForCausalLM
        overrides = {**(overrides or {}), "architectures": [EAGLE_HEAD_ARCHITECTURE]}
    config, params, _ = load_model(
        path,
        target.dtype,
        mesh=mesh,
        skip_tokenizer_init=True,
        hf_overrides=overrides,
        enable_expert_parallel=enable_expert_parallel,
        draft_head=spec.method in HEAD_METHODS,
    )
    return DraftModel(config, params, spec.method)


def check_draft(target: ModelConfig, draft: "DraftModel", has_windows: bool) -> None:
    """A ValueError for a draft the target cannot take drafts from (`has_windows`: the
    target's KV has windowed groups, core/kv_groups.py)."""
    method = draft.method
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config's {method} model has a vocabulary of "
            f"{draft.config.vocab_size} tokens, the target {target.vocab_size}: method "
            f"{method!r} needs the target's tokenizer"
        )
    # A head embeds with the target's table and reads its hidden rows: its widths are the
    # target's (EAGLE-3's fc reads target_hidden_size-wide rows).
    widths = {draft.config.hidden_size, draft.config.option("target_hidden_size")} - {None}
    if method in HEAD_METHODS and widths != {target.hidden_size}:
        raise ValueError(
            f"speculative_config's {method} head is made for a target of hidden size "
            f"{max(widths - {target.hidden_size})}, the target's is {target.hidden_size}: a "
            "head drafts only for the model it was trained on"
        )
    if has_windows or any(w is not None for w in draft.config.layer_windows or ()):
        raise ValueError(
            f"speculative_config method {method!r} does not run with sliding-window layers "
            "(hybrid KV groups) in the target or the draft yet"
        )


def num_drafts_room(
    request: Request, block_ids: list[int], num_speculative_tokens: int, block_size: int
) -> int:
    """How many drafts a request that decodes next can take: as many as its blocks have slots
    from its position p on (the scheduler's lookahead slots: a draft's KV is written at p..),
    at most k."""
    return min(num_speculative_tokens, len(block_ids) * block_size - request.num_computed_tokens)


def propose(
    params,
    kv_cache,
    inputs: StepInputs,
    active: jax.Array,
    first_index: jax.Array,
    *,
    model: ShardedModel,
    num_steps: int,
    block_size: int,
    choose: Callable,
):
    """k = `num_steps` draft decode steps from `inputs` (draft_positions.decode_after's: each
    sequence's token after its last kept position, at p) for the rows `active` bool[S],
    writing the draft's KV at p..p+k-1 -> (drafts i32[S, k], kv_cache). Draft i of a row stands
    for output index `first_index` i32[S] + i: `choose(logits, sampling, output_index, drafts,
    i)` picks it (draft_positions.choose_drafts, its step's plan, bias rows and history
    bound). The other rows write the null page, and their drafts are meaningless."""
    num_seqs = inputs.positions.shape[0]

    def body(i, carry):
        # Through a barrier with the carry, so that XLA does not hoist the weights' dtype
        # conversions out of the loop (decode_loop.decode_step says why).
        params_i, (kv, step_inputs, drafts) = jax.lax.optimization_barrier((params, carry))
        md = step_inputs.attn
        hidden, kv = model.forward(
            params_i, kv, step_inputs.token_ids, step_inputs.positions, md, None
        )
        logits = model.logits(params_i, hidden[md.logits_indices])  # [S, V]
        token_ids = choose(logits, step_inputs.sampling, first_index + i, drafts, i)  # [S]
        drafts = drafts.at[:, i].set(token_ids)
        tables = step_inputs.attn.block_tables
        next_active = active & in_table(step_inputs.positions + 1, tables, block_size)
        step_inputs = advance_inputs(step_inputs, token_ids, next_active, block_size)
        return kv, step_inputs, drafts

    drafts = jnp.zeros((num_seqs, num_steps), jnp.int32)
    kv_cache, _, drafts = jax.lax.fori_loop(0, num_steps, body, (kv_cache, inputs, drafts))
    return drafts, kv_cache


def draft_model_in_step(
    model: ShardedModel,
    params,
    kv_cache,
    inputs: StepInputs,
    sampled: jax.Array,
    targets: jax.Array,
    token_cache: jax.Array,
    *,
    num_drafts: int,
    block_size: int,
    choose: Callable,
):
    """The draft's k drafts for each sequence of a step that sampled, proposed from the token
    after its last kept position (`sampled` i32[S] the step's samples, `targets` i32[NP] its
    tokens at the scored positions, `token_cache` i32[P, B] the step's tokens written) ->
    (drafts i32[S, k], kv_cache); `choose`: draft_positions.choose_drafts with all but its
    history bound."""
    last_kept, next_tokens = last_kept_and_next_tokens(inputs, sampled, targets)
    history = draft_history(token_cache, inputs, last_kept, next_tokens)
    step_inputs = decode_after(inputs, last_kept, next_tokens[last_kept], block_size)
    active = step_inputs.attn.seq_lens > 0  # [S] the sequences that sampled
    return propose(
        params,
        kv_cache,
        step_inputs,
        active,
        first_draft_index(inputs, last_kept),
        model=model,
        num_steps=num_drafts,
        block_size=block_size,
        choose=functools.partial(choose, history=history),
    )
