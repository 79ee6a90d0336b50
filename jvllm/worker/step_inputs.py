"""Gather a scheduled step into flat, bucket-padded host arrays for the jitted step."""

import dataclasses
import functools

import jax
import numpy as np

from jvllm.attention.metadata import AttentionMetadata, GroupTables, build_tiles
from jvllm.core.request import Request
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.layers.image_embeds import ImageEmbeds
from jvllm.sample.metadata import SamplingMetadata
from jvllm.sampling_params import GREEDY_TEMPERATURE
from jvllm.worker.buckets import Bucket
from jvllm.worker.draft_scoring import DraftScoring, prepare_draft_scoring


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata
    sampling: SamplingMetadata
    # Speculative decoding's positions to score; None (nothing compiled for it) when off.
    drafts: DraftScoring | None = None
    # The image tokens' embeddings, for a model that takes images (worker/encoder_runner.py);
    # None for any other.
    mm: ImageEmbeds | None = None


def prepare_step_inputs(
    requests: list[Request],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    bucket: Bucket,
    block_size: int,
    max_pages: int,
    vocab_size: int,
    bias_slots: np.ndarray | None = None,
    token_bitmask: np.ndarray | None = None,
    adapter_slots: np.ndarray | None = None,
    draft_token_ids: list[list[int]] | None = None,
    num_speculative_tokens: int = 0,
    num_kv_groups: int = 1,
    window_block_ids: list[list[list[int]]] | None = None,
    draft_bitmask: np.ndarray | None = None,
) -> StepInputs:
    """Flatten the scheduled tokens of `requests` (row order = request order) into `bucket`.

    `bias_slots` (i32, one per request) are the requests' rows of the logit-bias table;
    `token_bitmask` (i32[len(requests), ceil(V / 32)]) their grammar masks, None for none;
    `adapter_slots` (i32, one per request, -1 for none) their LoRA slots, None where the
    engine serves no adapters. With speculation on (`num_speculative_tokens` > 0),
    `draft_token_ids` holds each request's drafts (None: none), the last of its scheduled
    tokens, and `draft_bitmask` the grammar masks of the drafts' positions
    (draft_scoring.prepare_draft_scoring), None for none. With `num_kv_groups` > 1 hybrid KV
    groups (core/kv_groups.py), `block_ids` are each request's first-group table and
    `window_block_ids` its others'."""
    num_tokens, num_seqs = bucket.num_tokens, bucket.num_seqs
    num_real = len(requests)
    params = [req.sampling_params for req in requests]

    def per_seq(values, dtype, pad=0) -> np.ndarray:  # one value per request, then padding
        out = np.full(num_seqs, pad, dtype)
        out[:num_real] = values
        return out

    # Per token, built at once: a Python loop over the requests' tokens costs milliseconds a
    # step at batch 64, which a GPU step does not hide.
    first = [req.num_computed_tokens for req in requests]  # each request's first position
    lens, starts = np.asarray(num_scheduled, np.int32), np.asarray(first, np.int32)  # [R]
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    query_start_loc[1 : num_real + 1] = np.cumsum(lens)
    num_real_tokens = int(query_start_loc[num_real])
    query_start_loc[num_real + 1 :] = num_real_tokens
    seq_of = np.repeat(np.arange(num_real), lens)  # [t] request of each real token
    pos = np.arange(num_real_tokens) - np.repeat(query_start_loc[:num_real] - starts, lens)

    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # pad -> null page 0
    block_tables = np.zeros((num_seqs, max_pages), np.int32)
    for s, (req, blocks, t, start, n) in enumerate(
        zip(requests, block_ids, query_start_loc.tolist(), first, num_scheduled)
    ):
        block_tables[s, : len(blocks)] = blocks
        known = req.all_token_ids[start : start + n]  # all but the drafts
        token_ids[t : t + len(known)] = known
        if draft_token_ids:
            token_ids[t + len(known) : t + n] = draft_token_ids[s]
    positions[:num_real_tokens] = pos
    page = block_tables[seq_of, pos // block_size]
    slot_mapping[:num_real_tokens] = page * block_size + pos % block_size
    seq_lens = per_seq(starts + lens, np.int32)
    kv_groups = None
    if num_kv_groups > 1:
        kv_groups = _group_tables(
            block_tables, window_block_ids or [], num_kv_groups, num_tokens, seq_of, pos, block_size
        )

    # A request with drafts samples the token after them (speculative decoding's bonus).
    drafted = draft_token_ids or [[]] * num_real
    num_outputs = [req.num_output_tokens + len(d) for req, d in zip(requests, drafted)]
    temperature = per_seq([p.temperature for p in params], np.float32)
    top_k = per_seq([max(p.top_k, 0) for p in params], np.int32)
    top_p = per_seq([p.top_p for p in params], np.float32, 1)
    min_p = per_seq([p.min_p for p in params], np.float32)
    penalized = [p if p.has_penalties else None for p in params]
    any_penalties = any(p is not None for p in penalized)
    presence = per_seq([p.presence_penalty if p else 0.0 for p in penalized], np.float32)
    frequency = per_seq([p.frequency_penalty if p else 0.0 for p in penalized], np.float32)
    repetition = per_seq([p.repetition_penalty if p else 1.0 for p in penalized], np.float32, 1)
    any_logprobs = any(p.logprobs is not None for p in params)
    prompt_target_ids = np.full(num_tokens, -1, np.int32)
    any_prompt_logprobs = False
    for s in (s for s, p in enumerate(params) if p.prompt_logprobs is not None):
        req, start, n = requests[s], first[s], num_scheduled[s]
        if start < req.num_prompt_tokens - 1:
            any_prompt_logprobs = True
            end, t = min(start + n, req.num_prompt_tokens - 1), int(query_start_loc[s])
            prompt_target_ids[t : t + end - start] = req.prompt_token_ids[start + 1 : end + 1]
    bias_slot = per_seq(bias_slots if bias_slots is not None else 0, np.int32)
    if token_bitmask is None:
        bitmask = _all_tokens_allowed(num_seqs, vocab_size)
    else:
        bitmask = np.full((num_seqs, token_bitmask.shape[1]), -1, np.int32)
        bitmask[:num_real] = token_bitmask
    logits_indices = np.maximum(query_start_loc[1:] - 1, 0)

    attn = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
        tiles=build_tiles(
            query_start_loc,
            seq_lens,
            num_real,
            bucket.tile_groups,
            max_split_queries=1 + num_speculative_tokens,  # a request's last token and drafts
        ),
        adapter_slots=_per_token(adapter_slots, lens, num_tokens),
        kv_groups=kv_groups,
    )
    sampling = SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=per_seq([req.seed for req in requests], np.uint32),
        output_index=per_seq(num_outputs, np.int32),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        num_prompt_tokens=per_seq([req.num_prompt_tokens for req in requests], np.int32),
        bias_slot=bias_slot,
        prompt_target_ids=prompt_target_ids,
        token_bitmask=bitmask,
        all_greedy=np.bool_(bool(np.all(temperature[:num_real] < GREEDY_TEMPERATURE))),
        any_filter=np.bool_(
            bool(np.any((top_k[:num_real] > 0) | (top_p[:num_real] < 1) | (min_p[:num_real] > 0)))
        ),
        any_penalties=np.bool_(any_penalties),
        any_bias=np.bool_(bool(bias_slot.any())),
        any_constrained=np.bool_(token_bitmask is not None),
        any_logprobs=np.bool_(any_logprobs),
        any_prompt_logprobs=np.bool_(any_prompt_logprobs),
    )
    drafts = None
    if num_speculative_tokens:
        drafts = prepare_draft_scoring(
            query_start_loc,
            draft_token_ids or [],
            bucket,
            num_speculative_tokens,
            bitmask.shape[1],
            draft_bitmask,
            [
                req.all_token_ids[start + n] if start + n < req.num_tokens else -1
                for req, start, n in zip(requests, first, num_scheduled)
            ],
        )
    return StepInputs(token_ids, positions, attn, sampling, drafts)


def window_block_ids(scheduler_output: SchedulerOutput) -> list[list[list[int]]] | None:
    """Each scheduled request's tables in the windowed KV groups, in row order; None without."""
    tables = scheduler_output.window_block_ids
    if not tables:
        return None
    return [tables[r.request_id] for r in scheduler_output.scheduled_requests]


def scheduled_drafts(scheduler_output: SchedulerOutput) -> list[list[int]] | None:
    """Each scheduled request's drafts, in row order ([] for one without); None for a step
    without any."""
    drafts = scheduler_output.spec_token_ids
    if not drafts:
        return None
    return [drafts.get(r.request_id, []) for r in scheduler_output.scheduled_requests]


def split_bitmask(token_bitmask: np.ndarray | None, num_reqs: int):
    """StructuredOutputManager.bitmask's rows -> (the requests' [num_reqs, W], their drafts'
    positions' or None)."""
    if token_bitmask is None or len(token_bitmask) <= num_reqs:
        return token_bitmask, None
    return token_bitmask[:num_reqs], token_bitmask[num_reqs:]


def _group_tables(
    block_tables: np.ndarray,
    window_block_ids: list[list[list[int]]],
    num_groups: int,
    num_tokens: int,
    seq_of: np.ndarray,
    pos: np.ndarray,
    block_size: int,
) -> GroupTables:
    """Every group's tables i32[G, S, M] (group 0: `block_tables` [S, M]) and slots i32[G, T]
    of the real tokens, `seq_of` and `pos` i32[t] (padding: the null page)."""
    tables = np.zeros((num_groups, *block_tables.shape), np.int32)
    tables[0] = block_tables
    for s, groups in enumerate(window_block_ids):
        for g, blocks in enumerate(groups, 1):
            tables[g, s, : len(blocks)] = blocks
    slots = np.zeros((num_groups, num_tokens), np.int32)
    slots[:, : len(pos)] = tables[:, seq_of, pos // block_size] * block_size + pos % block_size
    return GroupTables(tables, slots)


def _per_token(values: np.ndarray | None, lens: np.ndarray, num_tokens: int) -> np.ndarray | None:
    """One value per request -> i32[T]: each real token's request's value, -1 on padding;
    None stays None."""
    if values is None:
        return None
    out = np.full(num_tokens, -1, np.int32)
    out[: int(lens.sum())] = np.repeat(np.asarray(values, np.int32), lens)
    return out


@functools.cache
def _all_tokens_allowed(num_seqs: int, vocab_size: int) -> np.ndarray:
    """The bitmask of a step without structured outputs: one array per bucket, never written."""
    mask = np.full((num_seqs, (vocab_size + 31) // 32), -1, np.int32)
    mask.flags.writeable = False
    return mask
