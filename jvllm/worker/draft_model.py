"""Speculative decoding's "draft_model" method on the device (vLLM v1's DraftModelProposer).

The draft loads beside the target (same mesh, same dtype) with a KV cache of its own,
[L_d, V, K_d, P, B, H_d], over the SAME page ids: it reads the target's block tables, so it needs
no allocator, and the KV budget counts both models' bytes a block (kv_budget.py). Every step
runs the draft's forward (its KV only, no LM head) over the step's tokens inside the target's
jitted step (step_fn.model_step), so its cache holds every computed position, drafts included;
a rejected draft's position is written again by the step that computes it next.

After a step, each request that will decode next gets k drafts from `propose_greedy`: k draft
decode steps in one jitted call, from the token just sampled at position p, writing the draft's
KV at p..p+k-1 (the scheduler allocates those k lookahead slots: num_lookahead_tokens) and taking
the argmax each time. An argmax draft is deterministic, so the verification
(worker/draft_scoring.py) keeps the target's distribution exactly, greedy and seeded alike.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.core.request import Request
from jvllm.distributed.sharded_model import ShardedModel
from jvllm.worker.buckets import Bucket, BucketSpec
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.step_inputs import StepInputs, prepare_step_inputs


@dataclasses.dataclass
class DraftModel:
    """A loaded draft: its config and params (on the target's mesh), and the speculative
    method it drafts for: "draft_model", or "eagle3" (an EAGLE-3 head, worker/eagle.py)."""

    config: ModelConfig
    params: dict
    method: str = "draft_model"


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


def prepare_proposal(
    requests: list[Request],
    block_ids: list[list[int]],
    num_speculative_tokens: int,
    buckets: BucketSpec,
    block_size: int,
    max_pages: int,
    vocab_size: int,
) -> tuple[list[Request], list[int], Bucket, StepInputs, np.ndarray] | None:
    """The inputs of `propose_greedy` for requests that decode next (each has computed all but
    its last token, at position p) -> (the requests that get drafts, how many each, the decode
    bucket, its inputs, i32[S] steps a row); None when none has a slot at p. A request proposes
    as many drafts as its blocks have slots from p on, at most k."""
    room = [
        num_drafts_room(r, b, num_speculative_tokens, block_size)
        for r, b in zip(requests, block_ids)
    ]
    rows = [i for i, n in enumerate(room) if n >= 1]
    if not rows:
        return None
    num_steps = [room[i] for i in rows]
    bucket = buckets.select(len(rows), len(rows))
    requests = [requests[i] for i in rows]
    inputs = prepare_step_inputs(
        requests,
        [1] * len(rows),
        [block_ids[i] for i in rows],
        bucket,
        block_size,
        max_pages,
        vocab_size,
    )
    steps_per_row = np.ones(bucket.num_seqs, np.int32)  # padding rows write the null page
    steps_per_row[: len(rows)] = num_steps
    return requests, num_steps, bucket, inputs, steps_per_row


def propose_greedy(
    params,
    kv_cache,
    inputs: StepInputs,
    num_steps_per_row,
    *,
    model: ShardedModel,
    num_steps: int,
    block_size: int,
):
    """k = `num_steps` greedy draft decode steps from `inputs` (a decode bucket: each row's
    token just sampled, at its position p) -> (drafts i32[S, k], kv_cache). Row s runs
    `num_steps_per_row[s]` (i32[S], >= 1 for real rows) steps, writing the draft's KV at
    p..p+n-1; afterwards it writes the null page, and its drafts past n are meaningless."""
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
        token_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S]
        drafts = drafts.at[:, i].set(token_ids)
        active = i + 1 < num_steps_per_row
        step_inputs = advance_inputs(step_inputs, token_ids, active, block_size)
        return kv, step_inputs, drafts

    drafts = jnp.zeros((num_seqs, num_steps), jnp.int32)
    kv_cache, _, drafts = jax.lax.fori_loop(0, num_steps, body, (kv_cache, inputs, drafts))
    return drafts, kv_cache
