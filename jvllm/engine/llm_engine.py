"""LLMEngine: vLLM's synchronous engine. `step()` = schedule -> execute -> sample -> update."""

import dataclasses

from jvllm.core.request import Request
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.input_processor import PromptType
from jvllm.engine.live_requests import LiveRequests
from jvllm.engine.mm_processor import make_mm_processor
from jvllm.engine.output_processor import OutputProcessor
from jvllm.engine.pooling import make_pooling_processor
from jvllm.engine.request_factory import RequestFactory
from jvllm.engine.scheduler_factory import make_scheduler
from jvllm.engine.sleep import Peers, SleepMode
from jvllm.engine.step_executor import StepExecutor
from jvllm.engine.step_loop_lease import StepLoopLease
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.pooling_outputs import PoolingRequestOutput
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import SamplingParams
from jvllm.structured_output.manager import StructuredOutputManager
from jvllm.worker.worker import Worker

logger = init_logger(__name__)


class LLMEngine:
    """vLLM's EngineCore and LLMEngine in one: the scheduler, the structured-output manager,
    the requests (made in engine/request_factory.py, held to their last output in
    engine/live_requests.py) and the step that runs them (engine/step_executor.py), over a
    Worker that owns the device (worker/worker.py)."""

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
        self._requests = LiveRequests(self.scheduler, self.output_processor)
        self._executor = StepExecutor(
            self.scheduler, worker, self.structured_outputs, self.output_processor, self.pooling
        )
        # Requests that finished in the last step, for observers such as jvllm.tracing.
        self.last_finished_requests: list[Request] = []
        # The requests a jvllm.step_loop.StepLoop decodes, between its prefill and finish.
        self._step_loop_lease = StepLoopLease(self.scheduler)
        # sleep, wake_up and load_weights (engine/sleep.py; the device half is the worker's)
        load = config.load_config
        self.sleep_mode = SleepMode(self, load.enable_sleep_mode, load.quantization)
        # Process 0's engine of one that spans several processes: the others, which run its
        # sleep, wake_up, load_weights and reset_prefix_cache too (engine/sleep.py).
        self.peers: Peers | None = None

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
        parent, requests = self._request_factory.make(*args, is_in_use=self.has_request)
        if self.pooling is not None or isinstance(params, PoolingParams):
            (request,) = requests
            self._requests.add(request)
            self.pooling.add_request(request)
            self.scheduler.add_request(request)
            return
        for index, request in enumerate(requests):
            self._requests.add(request, parent)
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
        self._requests.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache block (vLLM's), so that no later request reuses KV computed
        before; False, changing nothing, while running requests hold blocks."""
        if self.peers is not None:
            self.peers.announce("reset_prefix_cache")
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

    def wait_for_grammars(self) -> None:
        """Block up to 50 ms for a grammar compiling (what holds the waiting requests of a
        step with nothing to schedule)."""
        self.structured_outputs.wait(timeout=0.05)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or the parent of n > 1 samples) is still live."""
        return request_id in self._requests

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(
        self, wait_for_grammars: bool = True
    ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """schedule -> execute (forward + sample: one jitted call) -> update -> outputs.
        `wait_for_grammars`: with nothing to schedule but waiting requests (only grammars
        compiling hold them), wait a moment for one rather than return at once (a group of
        ranks' front waits for its ranks instead: engine/data_parallel.py)."""
        scheduler_output = self.scheduler.schedule()
        if wait_for_grammars and scheduler_output.is_empty and self.scheduler.waiting:
            self.wait_for_grammars()
        try:
            runner_output = self._executor.execute(scheduler_output)
        except Exception as error:  # noqa: BLE001 - any failure of the step aborts its requests only
            self._executor.abort(scheduler_output, error)
            self.last_finished_requests = list(scheduler_output.scheduled_requests)
            return self._requests.end(self.last_finished_requests)  # reported as aborted
        sampled, finished = self._executor.update(scheduler_output, runner_output)
        if self.pooling is not None:  # a request finishes with its vector
            self.last_finished_requests = finished
            return self._requests.end(finished)
        self._executor.propose_drafts(scheduler_output)
        outputs, self.last_finished_requests = self._requests.step_outputs(
            scheduler_output, sampled, finished
        )
        return outputs
