"""The pooling step: a forward over the step's prefill chunks, each request's hidden states
reduced on the device to one row, so that a step sends f32[S, D] to the host, never [T, D].

Every pooling type is a weighted sum over a request's prompt, which chunked prefill splits into
steps: each step returns its chunk's share and the host adds the shares up (engine/pooling.py).
LAST weighs the last prompt token 1, CLS the first, MEAN every token 1 / n; a chunk without
the chosen token returns zeros. The weights are data, so one executable per bucket serves all
three.
"""

import dataclasses

import jax
import numpy as np

from jvllm.attention.metadata import AttentionMetadata
from jvllm.core.request import Request
from jvllm.worker.step_inputs import StepInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolInputs:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    attn: AttentionMetadata
    weights: jax.Array  # f32[T] each token's weight in its request's pooled vector; pad 0
    seq_ids: jax.Array  # i32[T] each token's row; pad S (out of range: dropped)


def pool_step(params, kv_cache, inputs: PoolInputs, *, forward):
    """forward + per-request weighted sum -> (pooled f32[S, D], kv_cache)."""
    md = inputs.attn
    hidden, kv_cache = forward(params, kv_cache, inputs.token_ids, inputs.positions, md)  # [T, D]
    num_seqs = md.seq_lens.shape[0]
    pooled = jax.ops.segment_sum(
        hidden * inputs.weights[:, None], inputs.seq_ids, num_segments=num_seqs
    )  # [S, D]
    return pooled, kv_cache


def prepare_pool_inputs(
    step: StepInputs, requests: list[Request], num_scheduled: list[int], pooling_type: str
) -> PoolInputs:
    """The step's forward inputs and each token's (weight, row) for `pooling_type`."""
    num_tokens, num_seqs = step.token_ids.shape[0], step.attn.seq_lens.shape[0]
    weights = np.zeros(num_tokens, np.float32)
    seq_ids = np.full(num_tokens, num_seqs, np.int32)
    t = 0
    for s, (request, n) in enumerate(zip(requests, num_scheduled)):
        start, num_prompt = request.num_computed_tokens, request.num_prompt_tokens
        seq_ids[t : t + n] = s
        if pooling_type == "MEAN":
            weights[t : t + n] = 1.0 / num_prompt
        elif pooling_type == "LAST" and start + n == num_prompt:
            weights[t + n - 1] = 1.0
        elif pooling_type == "CLS" and start == 0:
            weights[t] = 1.0
        t += n
    return PoolInputs(step.token_ids, step.positions, step.attn, weights, seq_ids)
