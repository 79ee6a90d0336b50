"""The middle of an LLMEngine step, between the scheduler's plan and the requests' outputs: the
scheduled tokens run on the worker's model runner (forward and sample in one jitted call, or
pooling), and what comes back goes to the scheduler (the sampled tokens, a window's round
drafts), the output processor (logprobs) and the drafter (the drafts a draft model proposed in
the step). A step whose call failed is undone in the caches and its requests aborted instead."""

import time

import numpy as np

from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.core.spec_decode import can_draft
from jvllm.engine.output_processor import OutputProcessor
from jvllm.engine.pooling import PoolingOutputProcessor
from jvllm.logger import init_logger
from jvllm.structured_output.manager import StructuredOutputManager
from jvllm.worker.runner_output import ModelRunnerOutput

logger = init_logger(__name__)


class StepExecutor:
    """`worker`: the engine's device side (worker/worker.py, or a rank's view of a group);
    `pooling`: the engine's pooling processor, None for one that generates."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker,
        structured_outputs: StructuredOutputManager,
        output_processor: OutputProcessor | PoolingOutputProcessor,
        pooling: PoolingOutputProcessor | None,
    ) -> None:
        self._scheduler = scheduler
        self._worker = worker
        self._structured_outputs = structured_outputs
        self._output_processor = output_processor
        self._pooling = pooling

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | np.ndarray | None:
        """Run the model on the scheduled tokens and sample (pool: f32[num_reqs, D])."""
        requests = scheduler_output.scheduled_requests
        now = time.time()
        for request in requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        if not requests:
            return None
        block_ids = [scheduler_output.block_ids[r.request_id] for r in requests]
        model_runner = self._worker.model_runner
        if self._pooling is not None:
            return model_runner.execute_pooling(scheduler_output, block_ids)
        bitmask = self._structured_outputs.bitmask(
            requests, scheduler_output.will_sample, scheduler_output.spec_token_ids
        )
        return model_runner.execute_model(scheduler_output, block_ids, bitmask)

    def abort(self, scheduler_output: SchedulerOutput, error: Exception) -> None:
        """The model step raised (call it while handling `error`): abort the step's requests,
        forgetting the cache entries of blocks it did not write, and say why in each."""
        requests = scheduler_output.scheduled_requests
        logger.exception(
            "the model step failed; aborting its %d requests: %s",
            len(requests),
            ", ".join(r.request_id for r in requests),
        )
        manager = self._scheduler.kv_cache_manager
        for request in requests:
            manager.uncache_uncomputed_blocks(request)
        # The images it was to encode are not held: a later request would read them.
        self._worker.drop_images(self._scheduler.encoder.forget(scheduler_output))
        self._scheduler.finish_requests(
            [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
        )
        for request in requests:
            request.status_message = f"the model step failed: {error!r}"

    def update(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput | np.ndarray | None,
    ) -> tuple[dict[str, int | list[int]], list[Request]]:
        """Hand the step's results to the scheduler -> (request id -> token(s), finished).

        Pooling: the pooled shares go to the pooling processor, and a request whose prompt is
        all computed finishes (the scheduler frees its blocks). Logprobs are recorded around
        the update: the prompt's before (they belong to the tokens computed so far), the
        sampled tokens' after they are appended, for the requests that sampled (known only
        before the update)."""
        if self._pooling is not None:
            self._pooling.add_step(scheduler_output, runner_output)
            return {}, self._scheduler.update_from_output(scheduler_output, {})
        if runner_output is None:
            return {}, self._scheduler.update_from_output(scheduler_output, {})
        requests = scheduler_output.scheduled_requests
        sampling = [r for r in requests if scheduler_output.will_sample(r)]
        num_outputs = {r.request_id: r.num_output_tokens for r in sampling}
        tokens = runner_output.sampled_token_ids
        if scheduler_output.num_steps > 1 or scheduler_output.spec_token_ids:  # lists
            sampled = {r.request_id: t for r, t in zip(requests, tokens)}
        else:
            sampled = {r.request_id: int(t) for r, t in zip(requests, tokens)}
        if runner_output.prompt_logprobs is not None:
            self._output_processor.add_step_prompt_logprobs(
                scheduler_output, runner_output.prompt_logprobs
            )
        round_drafts = runner_output.round_drafts
        if round_drafts is not None:  # a window of speculative rounds
            round_drafts = {r.request_id: n for r, n in zip(requests, round_drafts)}
        finished = self._scheduler.update_from_output(scheduler_output, sampled, round_drafts)
        now = time.time()
        for request in sampling:  # the metrics of every request that got tokens
            if request.status != RequestStatus.FINISHED_ABORTED:
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                request.metrics.last_token_time = now
        if runner_output.logprobs is not None:
            self._output_processor.add_step_logprobs(
                scheduler_output, runner_output.logprobs, sampling, num_outputs
            )
        return sampled, finished

    def propose_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """The drafts the step just run proposed (a draft model or head drafts inside the
        target's step) for its requests that sampled and decode next; the scheduler hands them
        over at their next decode."""
        drafter = self._scheduler.drafter
        if drafter is None or not drafter.uses_draft_model:
            return
        decoding = [
            (r, scheduler_output.block_ids[r.request_id])
            for r in scheduler_output.scheduled_requests
            if not r.is_finished
            and r.num_computed_tokens == r.num_tokens - 1
            and r.num_output_tokens > 0
            and can_draft(r)
        ]
        if decoding:
            requests, block_ids = zip(*decoding)
            model_runner = self._worker.model_runner
            drafter.set_proposals(model_runner.propose_drafts(list(requests), list(block_ids)))
