"""The engine's step body: forward + sample over one padded step, a pure function.

ModelRunner binds its statics and jits it; the decode windows, the step run ahead and
jvllm.step_loop chain it.
"""

import contextlib
import dataclasses
import functools

import jax

from jvllm.distributed.sharded_model import ShardedModel
from jvllm.layers.hidden_capture import capturing_layer_inputs
from jvllm.sample.metadata import SamplerOutput
from jvllm.sample.plan import SamplerPlan
from jvllm.sample.sampler import sample_step, sample_tokens
from jvllm.worker.draft_model import draft_model_in_step
from jvllm.worker.draft_positions import choose_drafts
from jvllm.worker.draft_scoring import score_drafts
from jvllm.worker.eagle import DraftHead, head_in_step
from jvllm.worker.step_inputs import StepInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CountedSamplerOutput(SamplerOutput):
    """A step's SamplerOutput and, for a model with routed experts, each MoE layer's count of
    the step's real tokens' assignments to each expert (layers/expert_counts.py); with a draft
    model or head, the drafts the step proposed (worker/draft_model.py, worker/eagle.py), which
    stay on the device until the runner hands each request its row (worker/proposal_runner.py)."""

    expert_counts: jax.Array | None = None  # i32[L_moe, E]
    draft_tokens: jax.Array | None = None  # i32[S, k] a draft model's or head's proposals


def model_step(
    params,
    kv_cache,
    token_cache,
    bias_rows,
    inputs: StepInputs,
    *,
    model: ShardedModel,
    max_logprobs: int,
    logprobs_mode: str = "raw_logprobs",
    plan: SamplerPlan = SamplerPlan.DYNAMIC,
    draft_model: ShardedModel | None = None,
    draft_head: DraftHead | None = None,
    num_drafts: int = 0,
):
    """forward + sample for one padded step -> (SamplerOutput, logits, kv_cache, token_cache).

    `token_cache: i32[P, B]` holds the token id of every KV slot (penalties read it); `logits:
    f32[S, V]` are each sequence's raw last-position logits (the step loop hands them out; the
    engine's executables drop them); `plan`: the sampler's stages (sample/plan.py). With
    speculation on, `out.draft_target_ids` holds the target's tokens at the drafts' positions
    and `out.draft_logprobs` their logprobs, sampled as the sampler samples. A model with routed
    experts returns a CountedSamplerOutput. With a `draft_model` (speculative decoding's
    "draft_model" method), `params` and `kv_cache` are (target's, draft's) pairs, the draft's
    forward writes its KV at the step's tokens too, and once the step has sampled the draft
    proposes `num_drafts` (k) tokens for each sequence (worker/draft_model.py). With a
    `draft_head` (an EAGLE-3 head or an MTP layer) they are (target's, head's) pairs the same
    way: the head runs over the step's positions once it has sampled, then proposes k tokens
    (worker/eagle.py). The output (a CountedSamplerOutput) then holds the drafts, i32[S, k].
    """
    md = inputs.attn
    if draft_model is not None or draft_head is not None:
        (params, draft_params), (kv_cache, draft_kv) = params, kv_cache
    if draft_model is not None:
        # Its KV alone: the hidden states are dropped, no LM head runs.
        _, draft_kv = draft_model.forward(
            draft_params, draft_kv, inputs.token_ids, inputs.positions, md, None
        )
    args = (params, kv_cache, inputs.token_ids, inputs.positions, md, inputs.mm)
    capture = contextlib.nullcontext()
    if draft_head is not None and draft_head.layer_ids is not None:
        # The head (EAGLE-3) reads the rows entering some of the target's layers.
        num_tokens = inputs.token_ids.shape[0]
        capture = capturing_layer_inputs(
            draft_head.layer_ids, num_tokens, draft_head.target_hidden_size
        )
    with capture as captured:
        if model.forward_counting_experts is None:
            (hidden, kv_cache), expert_counts = model.forward(*args), None
        else:
            hidden, kv_cache, expert_counts = model.forward_counting_experts(*args)
    num_pages, block_size = token_cache.shape
    token_cache = (
        token_cache.reshape(-1)
        .at[md.slot_mapping]
        .set(inputs.token_ids)
        .reshape(num_pages, block_size)
    )
    logits = model.logits(params, hidden[md.logits_indices])  # [S, V]
    out = sample_step(
        logits,
        hidden,
        inputs.sampling,
        bias_rows=bias_rows,
        token_cache=token_cache,
        block_tables=md.block_tables,
        seq_lens=md.seq_lens,
        logits_fn=lambda h: model.logits(params, h),
        max_logprobs=max_logprobs,
        logprobs_mode=logprobs_mode,
        plan=plan,
    )
    if inputs.drafts is not None:  # speculative decoding: verify the drafts
        sample_fn = functools.partial(
            sample_tokens,
            bias_rows=bias_rows,
            token_cache=token_cache,
            max_logprobs=max_logprobs,
            logprobs_mode=logprobs_mode,
            plan=plan,
        )
        # A sampler plan holds no conditional (on a GPU one waits for the host): score always.
        targets, target_logprobs = score_drafts(
            hidden,
            inputs.positions,
            md.block_tables,
            inputs.sampling,
            inputs.drafts,
            lambda h: model.logits(params, h),
            sample_fn,
            branch_free=plan is not SamplerPlan.DYNAMIC,
        )
        out = dataclasses.replace(out, draft_target_ids=targets, draft_logprobs=target_logprobs)
    draft_tokens = None
    # A draft's tokens: a greedy row's argmax, a sampled row's draw with its target's uniforms.
    choose = functools.partial(choose_drafts, plan=plan, bias_rows=bias_rows)
    if draft_model is not None:
        draft_tokens, draft_kv = draft_model_in_step(
            draft_model,
            draft_params,
            draft_kv,
            inputs,
            out.sampled_token_ids,
            out.draft_target_ids,
            token_cache,
            num_drafts=num_drafts,
            block_size=block_size,
            choose=choose,
        )
    if draft_head is not None:
        draft_kv, draft_tokens = head_in_step(
            draft_head,
            params,
            draft_params,
            draft_kv,
            inputs,
            hidden if draft_head.layer_ids is None else captured.rows,
            out.sampled_token_ids,
            out.draft_target_ids,
            token_cache,
            block_size,
            choose,
        )
    if expert_counts is not None or draft_tokens is not None:
        fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        out = CountedSamplerOutput(**fields, expert_counts=expert_counts, draft_tokens=draft_tokens)
    if draft_model is not None or draft_head is not None:
        kv_cache = (kv_cache, draft_kv)
    return out, logits, kv_cache, token_cache


def single_step(params, kv_cache, token_cache, bias_rows, inputs: StepInputs, *, step):
    """One step as the engine runs it -> (SamplerOutput, kv_cache, token_cache)."""
    out, _, kv_cache, token_cache = step(params, kv_cache, token_cache, bias_rows, inputs)
    return out, kv_cache, token_cache
