"""Gather a scheduled step into flat, bucket-padded host arrays for the jitted step."""

import dataclasses

import jax
import numpy as np

from jvllm.attention.metadata import AttentionMetadata, build_tiles
from jvllm.core.request import Request
from jvllm.sample.metadata import SamplingMetadata
from jvllm.sampling_params import GREEDY_TEMPERATURE
from jvllm.worker.buckets import Bucket


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata
    sampling: SamplingMetadata


def prepare_step_inputs(
    requests: list[Request],
    num_scheduled: list[int],
    block_ids: list[list[int]],
    bucket: Bucket,
    block_size: int,
    max_pages: int,
    bias_slots: np.ndarray | None = None,
) -> StepInputs:
    """Flatten the scheduled tokens of `requests` (row order = request order) into `bucket`.

    `bias_slots` (i32, one per request) are the requests' rows of the logit-bias table."""
    num_tokens, num_seqs = bucket.num_tokens, bucket.num_seqs
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # pad -> null page 0
    block_tables = np.zeros((num_seqs, max_pages), np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    output_index = np.zeros(num_seqs, np.int32)
    presence = np.zeros(num_seqs, np.float32)
    frequency = np.zeros(num_seqs, np.float32)
    repetition = np.ones(num_seqs, np.float32)
    num_prompt = np.zeros(num_seqs, np.int32)
    bias_slot = np.zeros(num_seqs, np.int32)
    prompt_target_ids = np.full(num_tokens, -1, np.int32)
    any_penalties = any_logprobs = any_prompt_logprobs = False

    t = 0
    for s, (req, n, blocks) in enumerate(zip(requests, num_scheduled, block_ids)):
        start = req.num_computed_tokens
        pos = np.arange(start, start + n, dtype=np.int32)
        table = np.asarray(blocks, np.int32)
        token_ids[t : t + n] = req.all_token_ids[start : start + n]
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = table[pos // block_size] * block_size + pos % block_size
        block_tables[s, : len(table)] = table
        seq_lens[s] = start + n
        t += n
        query_start_loc[s + 1] = t
        params = req.sampling_params
        temperature[s] = params.temperature
        top_k[s] = max(params.top_k, 0)
        top_p[s] = params.top_p
        min_p[s] = params.min_p
        seeds[s] = req.seed
        output_index[s] = req.num_output_tokens
        num_prompt[s] = req.num_prompt_tokens
        if params.has_penalties:
            any_penalties = True
            presence[s] = params.presence_penalty
            frequency[s] = params.frequency_penalty
            repetition[s] = params.repetition_penalty
        any_logprobs |= params.logprobs is not None
        if params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            any_prompt_logprobs = True
            end = min(start + n, req.num_prompt_tokens - 1)
            prompt_target_ids[t - n : t - n + end - start] = req.prompt_token_ids[
                start + 1 : end + 1
            ]
    num_real = len(requests)
    if bias_slots is not None:
        bias_slot[:num_real] = bias_slots
    query_start_loc[num_real + 1 :] = t
    logits_indices = np.maximum(query_start_loc[1:] - 1, 0)

    attn = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
        tiles=build_tiles(query_start_loc, seq_lens, num_real, bucket.tile_groups),
    )
    sampling = SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        output_index=output_index,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        num_prompt_tokens=num_prompt,
        bias_slot=bias_slot,
        prompt_target_ids=prompt_target_ids,
        all_greedy=np.bool_(bool(np.all(temperature[:num_real] < GREEDY_TEMPERATURE))),
        any_filter=np.bool_(
            bool(np.any((top_k[:num_real] > 0) | (top_p[:num_real] < 1) | (min_p[:num_real] > 0)))
        ),
        any_penalties=np.bool_(any_penalties),
        any_bias=np.bool_(bool(bias_slot.any())),
        any_logprobs=np.bool_(any_logprobs),
        any_prompt_logprobs=np.bool_(any_prompt_logprobs),
    )
    return StepInputs(token_ids, positions, attn, sampling)
