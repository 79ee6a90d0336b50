"""Gather a scheduled step into flat, bucket-padded host arrays for the jitted step."""

import dataclasses

import jax
import numpy as np

from jvllm.attention.metadata import AttentionMetadata, build_tiles
from jvllm.core.request import Request
from jvllm.sample.metadata import SamplingMetadata
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
) -> StepInputs:
    """Flatten the scheduled tokens of `requests` (row order = request order) into `bucket`."""
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
    num_real = len(requests)
    query_start_loc[num_real + 1 :] = t
    logits_indices = np.maximum(query_start_loc[1:] - 1, 0)

    tile_token_idx, tile_positions, tile_seq = build_tiles(
        query_start_loc, seq_lens, num_real, bucket.num_tiles, bucket.tile_q
    )
    attn = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        logits_indices=logits_indices,
        tile_token_idx=tile_token_idx,
        tile_positions=tile_positions,
        tile_seq=tile_seq,
    )
    sampling = SamplingMetadata(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=seeds,
        output_index=output_index,
        all_greedy=np.bool_(bool(np.all(temperature[:num_real] < 1e-5))),
    )
    return StepInputs(token_ids, positions, attn, sampling)
