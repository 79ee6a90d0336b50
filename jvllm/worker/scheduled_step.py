"""A schedule as the step executables take it and give it back: the kind of executable, the
bucket, the sampler plan and the arguments that a SchedulerOutput runs with (a step, a decode
window, a window of speculative rounds, a pooling step), and an executable's outputs read back
as the scheduled requests' results. Between the two the runner runs the executable over its
arrays (model_runner.py)."""

import dataclasses

import numpy as np

from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.sample.plan import SamplerPlan
from jvllm.worker.buckets import Bucket
from jvllm.worker.decode_loop import WindowInputs, prepare_window_inputs
from jvllm.worker.draft_scoring import with_accepted_runs
from jvllm.worker.encoder_runner import EncoderRunner
from jvllm.worker.pooler import PoolInputs, prepare_pool_inputs
from jvllm.worker.runner_output import ModelRunnerOutput, as_window, fetch_output
from jvllm.worker.spec_window import SpecWindowOutput, fetch_spec_window, first_round
from jvllm.worker.step_compiler import StepCompiler
from jvllm.worker.step_inputs import (
    StepInputs,
    scheduled_drafts,
    split_bitmask,
    window_block_ids,
)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """A scheduled step laid out for its executable, `StepCompiler.executable(bucket, kind,
    plan)`, which takes `args` after the runner's arrays."""

    bucket: Bucket
    kind: str  # "step", "window" or "spec_window"
    plan: SamplerPlan
    inputs: StepInputs
    window: WindowInputs | None  # a decode window's rows' limits and stop ids; None: a step

    @property
    def args(self) -> tuple:
        return (self.inputs,) if self.window is None else (self.inputs, self.window)


def prepare_step(
    compiler: StepCompiler,
    encoder: EncoderRunner | None,
    scheduler_output: SchedulerOutput,
    block_ids: list[list[int]],
    bias_slots: np.ndarray,
    adapter_slots: np.ndarray | None,
    token_bitmask: np.ndarray | None,
) -> ScheduledStep:
    """`scheduler_output`'s step laid out as `compiler.layout` says: a decode window runs a
    "window", with drafts a "spec_window" whose first round verifies the scheduler's drafts;
    any other step a "step", scoring its drafts' positions with speculation on. A step lent a
    compiled bucket while its own compiles samples DYNAMIC. `encoder`: the images' embeddings,
    for a model that takes images. `bias_slots`, `adapter_slots` and `token_bitmask` as
    prepare_step_inputs takes them, the bitmask's rows past the requests' their drafts'."""
    requests = scheduler_output.scheduled_requests
    num_reqs = len(requests)
    layout = compiler.layout
    counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
    is_window = scheduler_output.num_steps > 1
    draft_lists = scheduled_drafts(scheduler_output)
    kind = "window" if is_window else "step"
    if is_window and layout.num_speculative_tokens:
        kind = "spec_window"
        draft_lists, counts = first_round(draft_lists, num_reqs, layout.num_speculative_tokens)
    bucket, lent = compiler.select_bucket(sum(counts), num_reqs, kind)
    token_bitmask, draft_bitmask = split_bitmask(token_bitmask, num_reqs)
    inputs = layout.inputs(
        requests,
        counts,
        block_ids,
        bucket,
        bias_slots=bias_slots,
        token_bitmask=token_bitmask,
        adapter_slots=adapter_slots,
        draft_token_ids=draft_lists,
        draft_bitmask=draft_bitmask,
        window_block_ids=window_block_ids(scheduler_output),
    )
    if encoder is not None:
        inputs = encoder.with_images(inputs, requests, counts)
    plan = SamplerPlan.DYNAMIC if lent else compiler.plan(inputs)  # none compiles for a loan
    window = None
    if is_window:
        limits = [scheduler_output.window_limits[r.request_id] for r in requests]
        window = prepare_window_inputs(requests, limits, bucket.num_seqs)
    return ScheduledStep(bucket, kind, plan, inputs, window)


def prepare_pool_step(
    compiler: StepCompiler, scheduler_output: SchedulerOutput, block_ids: list[list[int]]
) -> tuple[Bucket, PoolInputs]:
    """A pooling runner's scheduled step laid out in its bucket, for its "pool" executable
    (worker/pooler.py)."""
    requests = scheduler_output.scheduled_requests
    counts = [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests]
    bucket, _ = compiler.select_bucket(sum(counts), len(requests), "pool")
    step = compiler.layout.inputs(
        requests, counts, block_ids, bucket, window_block_ids=window_block_ids(scheduler_output)
    )
    return bucket, prepare_pool_inputs(step, requests, counts, compiler.pooling_type)


def read_results(
    out,
    scheduler_output: SchedulerOutput,
    rows: list[int],
    any_logprobs: bool,
    any_prompt_logprobs: bool,
) -> ModelRunnerOutput:
    """Wait for a step's device outputs `out` -> the scheduled requests' results, request i's
    from row `rows[i]`: a window of speculative rounds' tokens and each round's drafts, a decode
    window's tokens as a list each, a step's with drafts each request's accepted run as a list,
    any other step's one token each. `any_prompt_logprobs` only for a step that computed them."""
    requests = scheduler_output.scheduled_requests
    if isinstance(out, SpecWindowOutput):
        return fetch_spec_window(out, len(requests), any_logprobs)
    is_window = scheduler_output.num_steps > 1
    result = fetch_output(out, rows, is_window, any_logprobs, any_prompt_logprobs)
    drafts = scheduled_drafts(scheduler_output)
    if drafts is not None and not is_window:
        result = with_accepted_runs(result, out, drafts)
    return result


def read_rank_results(
    kind: str,
    out,
    scheduler_output: SchedulerOutput,
    rows: list[int],
    any_logprobs: bool,
    any_prompt_logprobs: bool,
    drafts: list[list[int]] | None,
) -> ModelRunnerOutput:
    """One rank's result of a group of ranks' `kind` executable (worker/rank_group.py), `out`
    its rows on the host, request i's in row `rows[i]`, as its own runner would give it
    (read_results): a window of speculative rounds' tokens and each round's drafts; a decode
    window's tokens as a list each; a step's with `drafts` each request's accepted run as a
    list, a window's requests run as a step their one token as a list (`as_window`).
    `any_prompt_logprobs` only for a step that computed them."""
    num_reqs = len(scheduler_output.scheduled_requests)
    if kind == "spec_window":
        return fetch_spec_window(out, num_reqs, any_logprobs)
    is_step = kind == "step"
    result = fetch_output(
        out, rows, kind == "window", any_logprobs, is_step and any_prompt_logprobs
    )
    if drafts:  # each request's run, a list
        return with_accepted_runs(result, out, drafts)
    if is_step and scheduler_output.num_steps > 1:
        return as_window(result)
    return result
