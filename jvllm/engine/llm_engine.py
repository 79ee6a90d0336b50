"""LLMEngine: vLLM's synchronous engine. `step()` = schedule -> execute -> sample -> update."""

import dataclasses
import time

import numpy as np

from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.core.spec_decode import can_draft
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.input_processor import PromptType
from jvllm.engine.mm_processor import make_mm_processor
from jvllm.engine.output_processor import OutputProcessor
from jvllm.engine.pooling import make_pooling_processor
from jvllm.engine.request_factory import RequestFactory
from jvllm.engine.scheduler_factory import make_scheduler
from jvllm.engine.sleep import SleepMode
from jvllm.engine.step_loop_lease import StepLoopLease
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.pooling_outputs import PoolingRequestOutput
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import SamplingParams
from jvllm.structured_output.manager import StructuredOutputManager
from jvllm.worker.runner_output import ModelRunnerOutput
from jvllm.worker.worker import Worker

logger = init_logger(__name__)


class LLMEngine:
    """vLLM's EngineCore and LLMEngine in one: the scheduler, the structured-output manager,
    the requests and their outputs, over a Worker that owns the device (worker/worker.py)."""

    def __init__(self, model: str | None = None, *, worker=None, **kwargs):
        """`worker`: a device side made elsewhere for this engine's config, a Worker's view
        (one rank of a group whose MoE layers run across data-parallel ranks,
        worker/rank_group_worker.py); None: the engine's own Worker."""
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.worker = worker = worker or Worker(config)
        # The config resolved against the model (max_model_len, the attention backend).
        self.engine_config = config = worker.config
        self.model_config = worker.model_config  # the loaded model's architecture
        self.tokenizer = worker.tokenizer
        self.generation_config = worker.generation_config
        self.max_model_len = config.max_model_len
        # runner="pooling": requests pool their prompts (engine/pooling.py); None: generate.
        self.pooling = make_pooling_processor(config, self.model_config, worker.hf_config)
        num_blocks = worker.determine_num_blocks()
        if self.generation_config.sampling_defaults:
            logger.info(
                "default sampling parameters from the model's generation_config.json: %s "
                "(generation_config='vllm' ignores them)",
                self.generation_config.sampling_defaults,
            )
        can_cache_prefix = self.pooling is None or self.pooling.can_cache_prefix
        self.scheduler = make_scheduler(config, num_blocks, can_cache_prefix)
        worker.initialize_runner(num_blocks)
        worker.compile_or_warm_up_model()
        self.output_processor = self.pooling or OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer,
            self.model_config.vocab_size,
            self.eos_token_ids,
            synchronous=self.model_runner.compiler.lockstep,
        )
        scheduling = config.scheduler_config
        self._request_factory = RequestFactory(
            self.tokenizer,
            self.model_config,
            self.max_model_len,
            config.load_config.max_logprobs,
            self.eos_token_ids,
            self.structured_outputs,
            config.load_config.seed,
            self.get_default_sampling_params,
            scheduling.policy,
            self.model_runner.adapters,
            self.pooling,
            make_mm_processor(
                config.load_config.model,
                self.model_config,
                config.multimodal_config,
                self.tokenizer,
            ),
            scheduling.max_num_batched_tokens if scheduling.keep_images_whole else None,
        )
        self._requests: dict[str, Request] = {}
        # n > 1: parent request id -> child ids, and each live child's parent.
        self._children: dict[str, list[str]] = {}
        self._parent_of: dict[str, str] = {}
        # Requests that finished in the last step, for observers such as jvllm.tracing.
        self.last_finished_requests: list[Request] = []
        # The requests a jvllm.step_loop.StepLoop decodes, between its prefill and finish.
        self._step_loop_lease = StepLoopLease(self.scheduler)
        # sleep, wake_up and load_weights (engine/sleep.py; the device half is the worker's)
        load = config.load_config
        self.sleep_mode = SleepMode(self, load.enable_sleep_mode, load.quantization)

    @property
    def model_runner(self):
        """The worker's model runner (its params, KV cache and compiled steps)."""
        return self.worker.model_runner

    @property
    def mm_processor(self):
        """The processor of prompts' images (engine/mm_processor.py); None for a model that
        takes none."""
        return self._request_factory.mm_processor

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(**dataclasses.asdict(engine_args))

    def get_tokenizer(self):
        return self.tokenizer

    def check_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """Raise what add_request would for this request, enqueueing nothing: a front end's
        check for an engine in another process (engine/process_data_parallel.py)."""
        args = (request_id, prompt, params, arrival_time, priority, lora_request)
        self._request_factory.make(*args, is_in_use=lambda _: False)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        """Validate and enqueue a request; raises ValueError/TypeError without side effects.
        `lora_request`: the LoRARequest it runs with (enable_lora=True), None for the base model.

        With `n > 1` the request runs as n child requests that share the prompt's KV blocks
        through the prefix cache; its outputs still carry `request_id`. `priority` (vLLM's):
        lower is served first under scheduling_policy="priority", and must be 0 otherwise."""
        if self.held_by_step_loop:
            raise RuntimeError(
                "a StepLoop holds this engine's KV cache between its prefill() and finish(): "
                "finish the loop before adding requests"
            )
        self.sleep_mode.check_awake()
        args = (request_id, prompt, params, arrival_time, priority, lora_request)
        in_use = lambda i: i in self._requests or i in self._children
        parent, requests = self._request_factory.make(*args, is_in_use=in_use)
        if self.pooling is not None or isinstance(params, PoolingParams):
            (request,) = requests
            self._requests[request_id] = request
            self.pooling.add_request(request)
            self.scheduler.add_request(request)
            return
        if parent is not None:
            self._children[request_id] = parent.child_ids
            self._parent_of.update((c, request_id) for c in parent.child_ids)
        for index, request in enumerate(requests):
            self._requests[request.request_id] = request
            self.output_processor.add_request(request, parent, index)
            self.scheduler.add_request(request)
        logger.debug(
            "added request %s (%d prompt tokens, n=%d)",
            request_id,
            requests[0].num_prompt_tokens,
            len(requests),
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults of the model's generation_config.json."""
        return SamplingParams(**self.generation_config.sampling_defaults)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id of the model (Llama 3 has several): config.json's, then
        generation_config.json's, then the tokenizer's."""
        ids = list(self.model_config.eos_token_ids)
        ids += [i for i in self.generation_config.eos_token_ids if i not in ids]
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tokenizer_eos is not None and tokenizer_eos not in ids:
            ids.append(tokenizer_eos)
        return tuple(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Finish requests as FINISHED_ABORTED and free their KV blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [child for i in ids for child in self._children.get(i, [i])]
        live = [i for i in dict.fromkeys(ids) if i in self._requests]  # each once
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for child_id in live:
            self._finish(self._requests[child_id])
            self.output_processor.make_output(self._requests.pop(child_id))

    def _finish(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        parent_id = self._parent_of.pop(request.request_id, None)
        if parent_id is not None and not any(
            c in self._parent_of for c in self._children[parent_id]
        ):
            del self._children[parent_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache block (vLLM's), so that no later request reuses KV computed
        before; False, changing nothing, while running requests hold blocks."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the device (vLLM's; enable_sleep_mode=True, no request unfinished): level 1
        keeps the weights in host memory, level 2 discards them too (engine/sleep.py)."""
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep freed: `tags` among "weights", "kv_cache" (None: both)."""
        self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    def load_weights(self, weights) -> set[str]:
        """New weights from (HF name, array) pairs, as vLLM's model.load_weights takes them
        (a subset is fine); the prefix cache is reset. -> the paths of the params replaced."""
        return self.sleep_mode.load_weights(weights)

    @property
    def spec_decoding_stats(self):
        """Speculative decoding's counters (a core.spec_decode.SpecDecodingStats: vLLM's
        num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos) since
        start-up; None without a speculative_config."""
        drafter = self.scheduler.drafter
        return None if drafter is None else drafter.stats

    @property
    def held_by_step_loop(self) -> bool:
        """Whether a jvllm.step_loop.StepLoop holds this engine's requests and KV arrays."""
        return self._step_loop_lease.is_held

    def lend_to_step_loop(
        self, requests: list[Request], limits: list[int]
    ) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Take running `requests` out of the scheduler for a jvllm.step_loop.StepLoop, each
        given the KV blocks for `limits[i]` tokens in all (engine/step_loop_lease.py); the
        engine takes no request until `end_step_loop`. -> each one's block ids, and its
        tables in the windowed KV groups."""
        return self._step_loop_lease.lend(requests, limits)

    def end_step_loop(self, request_ids: list[str]) -> None:
        """Take back what lend_to_step_loop lent and abort the loop's requests, whose blocks go
        back to the pool."""
        self._step_loop_lease.take_back()
        self.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or the parent of n > 1 samples) is still live."""
        return request_id in self._requests or request_id in self._children

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """schedule -> execute (forward + sample: one jitted call) -> update -> outputs."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.scheduler.waiting:
            self.structured_outputs.wait(timeout=0.05)  # only grammars compiling hold them
        try:
            runner_output = self._execute(scheduler_output)
        except Exception as error:  # noqa: BLE001 - any failure of the step aborts its requests only
            return self._fail_step(scheduler_output, error)
        if self.pooling is not None:
            return self._pooling_outputs(scheduler_output, runner_output)
        sampled, finished = self._update(scheduler_output, runner_output)
        self._propose_drafts(scheduler_output)
        return self._process_outputs(scheduler_output, sampled, finished)

    def _propose_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """The drafts the step just run proposed (a draft model or head drafts inside the
        target's step) for its requests that sampled and decode next; the scheduler hands them
        over at their next decode."""
        drafter = self.scheduler.drafter
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
            drafter.set_proposals(self.model_runner.propose_drafts(list(requests), list(block_ids)))

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | np.ndarray | None:
        """Run the model on the scheduled tokens and sample (pool: f32[num_reqs, D])."""
        requests = scheduler_output.scheduled_requests
        now = time.time()
        for request in requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
        if not requests:
            return None
        block_ids = [scheduler_output.block_ids[r.request_id] for r in requests]
        if self.pooling is not None:
            return self.model_runner.execute_pooling(scheduler_output, block_ids)
        bitmask = self.structured_outputs.bitmask(
            requests, scheduler_output.will_sample, scheduler_output.spec_token_ids
        )
        return self.model_runner.execute_model(scheduler_output, block_ids, bitmask)

    def _update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | None
    ) -> tuple[dict[str, int | list[int]], list[Request]]:
        """Hand the sampled tokens to the scheduler -> (request id -> token(s), finished).

        Logprobs are recorded around it: the prompt's before (they belong to the tokens computed
        so far), the sampled tokens' after they are appended, for the requests that sampled
        (known only before the update)."""
        if runner_output is None:
            return {}, self.scheduler.update_from_output(scheduler_output, {})
        requests = scheduler_output.scheduled_requests
        sampling = [r for r in requests if scheduler_output.will_sample(r)]
        num_outputs = {r.request_id: r.num_output_tokens for r in sampling}
        tokens = runner_output.sampled_token_ids
        if scheduler_output.num_steps > 1 or scheduler_output.spec_token_ids:  # lists
            sampled = {r.request_id: t for r, t in zip(requests, tokens)}
        else:
            sampled = {r.request_id: int(t) for r, t in zip(requests, tokens)}
        if runner_output.prompt_logprobs is not None:
            self.output_processor.add_step_prompt_logprobs(
                scheduler_output, runner_output.prompt_logprobs
            )
        round_drafts = runner_output.round_drafts
        if round_drafts is not None:  # a window of speculative rounds
            round_drafts = {r.request_id: n for r, n in zip(requests, round_drafts)}
        finished = self.scheduler.update_from_output(scheduler_output, sampled, round_drafts)
        now = time.time()
        for request in sampling:  # the metrics of every request that got tokens
            if request.status != RequestStatus.FINISHED_ABORTED:
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = now
                request.metrics.last_token_time = now
        if runner_output.logprobs is not None:
            self.output_processor.add_step_logprobs(
                scheduler_output, runner_output.logprobs, sampling, num_outputs
            )
        return sampled, finished

    def _pooling_outputs(
        self, scheduler_output: SchedulerOutput, pooled: np.ndarray | None
    ) -> list[PoolingRequestOutput]:
        """Add the step's pooled shares; a request whose prompt is all computed finishes with
        its vector (the scheduler frees its blocks)."""
        self.pooling.add_step(scheduler_output, pooled)
        finished = self.scheduler.update_from_output(scheduler_output, {})
        self.last_finished_requests = finished
        outputs = []
        for request in finished:
            self._finish(request)
            del self._requests[request.request_id]
            outputs.append(self.pooling.make_output(request))
        return outputs

    def _fail_step(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> list[RequestOutput]:
        """The model step raised: abort the step's requests (and forget the cache entries of
        blocks it did not write), report them as aborted, and keep the engine serving."""
        requests = scheduler_output.scheduled_requests
        logger.exception(
            "the model step failed; aborting its %d requests: %s",
            len(requests),
            ", ".join(r.request_id for r in requests),
        )
        manager = self.scheduler.kv_cache_manager
        for request in requests:
            manager.uncache_uncomputed_blocks(request)
        # The images it was to encode are not held: a later request would read them.
        self.worker.drop_images(self.scheduler.encoder.forget(scheduler_output))
        self.scheduler.finish_requests(
            [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
        )
        outputs = []
        self.last_finished_requests = list(requests)
        for request in requests:
            request.status_message = f"the model step failed: {error!r}"
            self._finish(request)
            output = self.output_processor.make_output(request)
            if output is not None:
                outputs.append(output)
            del self._requests[request.request_id]
        return outputs

    def _process_outputs(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> list[RequestOutput]:
        changed = {
            r.request_id: r for r in scheduler_output.scheduled_requests if r.request_id in sampled
        }
        changed.update((r.request_id, r) for r in scheduler_output.finished_requests)
        changed.update((r.request_id, r) for r in finished)
        outputs = []
        self.last_finished_requests = []
        for request in changed.values():
            if request.request_id not in self._requests:
                continue  # aborted during this step: its output was made then
            output = self._output_for(request)
            if request.is_finished:
                self.last_finished_requests.append(request)
                self._requests.pop(request.request_id, None)
            if output is not None:
                outputs.append(output)
        return outputs

    def _output_for(self, request: Request) -> RequestOutput | None:
        """This step's output of one request; a failure here aborts that request alone."""
        try:
            if not request.is_finished and not self.output_processor.has_new_tokens(request):
                return None  # a prefill (or recompute) chunk: nothing to report yet
            stop = self.output_processor.detokenize(request)
            if stop is not None:
                if not request.is_finished:
                    self.scheduler.finish_requests(
                        [request.request_id], RequestStatus.FINISHED_STOPPED
                    )
                elif request.status == RequestStatus.FINISHED_LENGTH:
                    request.status = RequestStatus.FINISHED_STOPPED  # the text stopped first
                request.stop_reason = stop
            if request.is_finished:
                self._finish(request)
            return self.output_processor.make_output(request)
        except Exception as error:
            logger.exception(
                "request %s failed while processing its output; aborting it", request.request_id
            )
            request.status_message = f"processing its output failed: {error!r}"
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            request.status = RequestStatus.FINISHED_ABORTED  # also where it had finished already
            self._finish(request)
            self.output_processor.discard(request)
            return None
