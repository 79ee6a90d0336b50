"""Async scheduling: the next decode step is dispatched before this step's tokens are read.

While every running request decodes, the step after step n is step n's inputs advanced by one
token, the token each row samples in n, which is already on the device. So with
`async_scheduling=True` the runner dispatches that step (`next_decode_step`) right behind step n
and only then waits for n's tokens: the host's update, output processing and next schedule run
while the device computes step n+1. When the engine then schedules step n+1, the step dispatched
ahead is used if it holds that step: its requests are some of the rows run ahead, in the same
order, over the same blocks and logit-bias rows (the rows of requests that finished meanwhile
are ignored, and later steps run ahead keep them inactive); otherwise (a request arrived or
was preempted, a row needed a new block) it is dropped and the scheduled step runs. A dropped
step wrote only the next position of each of its rows: the same KV a rerun writes for rows that
go on, and nothing another request reads for rows that ended (their blocks are freed
afterwards, in device order).
"""

import dataclasses

from jvllm.core.decode_window import has_token_dependent_bans
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.sample.metadata import SamplerOutput
from jvllm.sample.plan import SamplerPlan
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import advance_inputs
from jvllm.worker.step_inputs import StepInputs


def next_decode_step(
    params, kv_cache, token_cache, bias_rows, inputs: StepInputs, sampled, active, *, step
):
    """The decode step after `inputs`' own, each active row (bool[S]) fed its token sampled
    there i32[S] -> (SamplerOutput, that step's inputs, kv_cache, token_cache)."""
    inputs = advance_inputs(inputs, sampled, active, token_cache.shape[1])
    out, _, kv_cache, token_cache = step(params, kv_cache, token_cache, bias_rows, inputs)
    return out, inputs, kv_cache, token_cache


@dataclasses.dataclass
class StepAhead:
    """A decode step dispatched ahead of its schedule: for which rows, over which blocks and
    bias rows, and its results (device arrays)."""

    request_ids: tuple[str | None, ...]  # each row's request; None: a row that ended before
    block_ids: list[list[int]]  # each row's blocks
    num_bias_sends: int  # BiasRows.num_sends when it was dispatched
    bucket: Bucket
    any_logprobs: bool
    plan: SamplerPlan  # its sampler plan, the step's before it (host-side: its inputs are not)
    out: SamplerOutput
    inputs: StepInputs

    @classmethod
    def of_rows(cls, rows: list[int], requests, block_ids: list[list[int]], **fields):
        """The step dispatched ahead whose `rows` hold `requests` over `block_ids`, in order,
        the bucket's other rows none; `fields` the rest of StepAhead's."""
        num_rows = fields["bucket"].num_seqs
        request_ids: list[str | None] = [None] * num_rows
        row_blocks: list[list[int]] = [[] for _ in range(num_rows)]
        for row, request, blocks in zip(rows, requests, block_ids, strict=True):
            request_ids[row], row_blocks[row] = request.request_id, blocks
        return cls(request_ids=tuple(request_ids), block_ids=row_blocks, **fields)


def can_run_ahead(
    scheduler_output: SchedulerOutput, block_ids: list[list[int]], block_size: int
) -> bool:
    """Whether the step after this one is known but for this step's tokens: this step decodes
    one token of every request, and the next would need no new block and keep every bias row
    (a request reaching min_tokens lifts its stop-id bans; multi-token bad words and grammar
    masks follow the tokens)."""
    if scheduler_output.num_steps > 1 or not scheduler_output.is_decode_only:
        return False
    for request, blocks in zip(scheduler_output.scheduled_requests, block_ids, strict=True):
        if request.num_tokens // block_size >= len(blocks):
            return False  # the token sampled now lands in a block not allocated yet
        if request.num_output_tokens + 1 == request.sampling_params.min_tokens:
            return False
        if has_token_dependent_bans(request):
            return False
    return True


def rows_ahead(
    ahead: StepAhead | None,
    scheduler_output: SchedulerOutput,
    block_ids: list[list[int]],
    num_bias_sends: int,
) -> list[int] | None:
    """The rows of `ahead` that hold the scheduled step's requests, in order, or None when it
    does not hold that step (call after the step's bias rows are sent)."""
    if ahead is None or scheduler_output.num_steps > 1 or not scheduler_output.is_decode_only:
        return None
    if ahead.num_bias_sends != num_bias_sends:
        return None
    rows, row = [], 0
    for request, blocks in zip(scheduler_output.scheduled_requests, block_ids, strict=True):
        while row < len(ahead.request_ids) and ahead.request_ids[row] != request.request_id:
            row += 1  # a request that finished since: the scheduler keeps the others' order
        if row == len(ahead.request_ids) or ahead.block_ids[row] != blocks:
            return None
        rows.append(row)
        row += 1
    return rows
