"""Async scheduling: the next decode step is dispatched before this step's tokens are read.

While every running request decodes, the step after step n is step n's inputs advanced by one
token, the token each row samples in n, which is already on the device. So with
`async_scheduling=True` the runner dispatches that step (`next_decode_step`) right behind step n
and only then waits for n's tokens: the host's update, output processing and next schedule run
while the device computes step n+1. When the engine then schedules step n+1, the step dispatched
ahead is used if it is exactly that step: the same requests in the same order over the same
blocks and logit-bias rows; otherwise (a request finished or was preempted, one arrived, a row
needed a new block) it is dropped and the scheduled step runs. A dropped step wrote only the
next position of each of its rows: the same KV a rerun writes for rows that go on, and nothing
another request reads for rows that ended (their blocks are freed afterwards, in device order).
"""

import dataclasses

from jvllm.core.scheduler import SchedulerOutput
from jvllm.sample.metadata import SamplerOutput
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.step_inputs import StepInputs


def next_decode_step(
    params, kv_cache, token_cache, bias_rows, inputs: StepInputs, sampled, *, step
):
    """The decode step after `inputs`' own, each row fed its token sampled there i32[S]
    -> (SamplerOutput, that step's inputs, kv_cache, token_cache)."""
    active = inputs.attn.seq_lens > 0  # the real rows
    inputs = advance_inputs(inputs, sampled, active, token_cache.shape[1])
    out, _, kv_cache, token_cache = step(params, kv_cache, token_cache, bias_rows, inputs)
    return out, inputs, kv_cache, token_cache


@dataclasses.dataclass
class StepAhead:
    """A decode step dispatched ahead of its schedule: for which rows, over which blocks and
    bias rows, and its results (device arrays)."""

    request_ids: tuple[str, ...]
    block_ids: list[list[int]]
    num_bias_sends: int  # BiasRows.num_sends when it was dispatched
    bucket: Bucket
    any_logprobs: bool
    out: SamplerOutput
    inputs: StepInputs


def can_run_ahead(
    scheduler_output: SchedulerOutput, block_ids: list[list[int]], block_size: int
) -> bool:
    """Whether the step after this one is known but for this step's tokens: this step decodes
    one token of every request, and the next would need no new block and keep every bias row
    (a request reaching min_tokens lifts its stop-id bans; multi-token bad words follow the
    tokens)."""
    if scheduler_output.num_steps > 1 or not scheduler_output.is_decode_only:
        return False
    for request, blocks in zip(scheduler_output.scheduled_requests, block_ids, strict=True):
        if request.num_tokens // block_size >= len(blocks):
            return False  # the token sampled now lands in a block not allocated yet
        if request.num_output_tokens + 1 == request.sampling_params.min_tokens:
            return False
        if any(len(word) > 1 for word in request.bad_words_token_ids):
            return False
    return True


def is_step_ahead(
    ahead: StepAhead | None,
    scheduler_output: SchedulerOutput,
    block_ids: list[list[int]],
    num_bias_sends: int,
) -> bool:
    """Whether `ahead` is the scheduled step (call after the step's bias rows are sent)."""
    if ahead is None or scheduler_output.num_steps > 1:
        return False
    request_ids = tuple(r.request_id for r in scheduler_output.scheduled_requests)
    return (
        ahead.request_ids == request_ids
        and scheduler_output.is_decode_only
        and ahead.block_ids == block_ids
        and ahead.num_bias_sends == num_bias_sends
    )
