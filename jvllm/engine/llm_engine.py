"""LLMEngine: vLLM's synchronous engine. `step()` = schedule -> execute -> sample -> update."""

import time

import numpy as np

from jvllm.attention.backends import default_backend
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jvllm.engine.arg_utils import EngineArgs, num_kv_blocks
from jvllm.engine.input_processor import PromptType, tokenize_prompt, validate_request
from jvllm.engine.output_processor import OutputProcessor
from jvllm.logger import init_logger
from jvllm.model_loader import load_model
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams
from jvllm.worker.buckets import BucketSpec
from jvllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs):
        self.args = args = EngineArgs(model=model, **kwargs)
        start = time.perf_counter()
        self.model_config, params, self.tokenizer = load_model(args.model, args.dtype)
        self.load_seconds = time.perf_counter() - start
        config = self.model_config
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        itemsize = 2 if config.dtype == "bfloat16" else 4
        bytes_per_block = (
            config.num_layers * 2 * config.num_kv_heads * args.block_size * config.head_dim * itemsize
        )
        num_blocks = num_kv_blocks(args, bytes_per_block, self.max_model_len)
        logger.info(
            "loaded %s (%s) in %.1fs; KV cache: %d blocks of %d tokens (%.0f MiB)",
            args.model or "the default model", config.dtype, self.load_seconds, num_blocks,
            args.block_size, num_blocks * bytes_per_block / 2**20,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                enable_chunked_prefill=args.enable_chunked_prefill,
            ),
            KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching),
        )
        self.attention_backend = args.attention_backend or default_backend()
        self.model_runner = ModelRunner(
            config,
            params,
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_model_len=self.max_model_len,
            buckets=BucketSpec(args.max_num_batched_tokens, args.max_num_seqs),
            attention_backend=self.attention_backend,
        )
        if args.compile_all_buckets:
            self.model_runner.compile_all()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seed_rng = np.random.default_rng(args.seed)
        self._requests: dict[str, Request] = {}
        # Requests that finished in the last step, for observers such as jvllm.tracing.
        self.last_finished_requests: list[Request] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        import dataclasses

        return cls(**dataclasses.asdict(engine_args))

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and enqueue a request; raises ValueError/TypeError without side effects."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, prompt_token_ids = tokenize_prompt(prompt, self.tokenizer)
        validate_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self._eos_token_id(),
            arrival_time=time.time() if arrival_time is None else arrival_time,
            prompt=prompt_text,
            seed=seed,
        )
        self._requests[request_id] = request
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)
        logger.debug("added request %s (%d prompt tokens)", request_id, len(prompt_token_ids))

    def _eos_token_id(self) -> int | None:
        eos = self.model_config.eos_token_id
        if isinstance(eos, tuple):
            eos = eos[0] if eos else None
        return eos if eos is not None else self.tokenizer.eos_token_id

    def abort_request(self, request_id: str | list[str]) -> None:
        """Finish requests as FINISHED_ABORTED and free their KV blocks; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = [i for i in ids if i in self._requests]
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for request_id in live:
            self.output_processor.make_output(self._requests.pop(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        sampled = self._execute(scheduler_output)
        finished = self.scheduler.update_from_output(scheduler_output, sampled)
        return self._process_outputs(scheduler_output, sampled, finished)

    def _execute(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Run the model on the scheduled tokens and sample: {request_id: token id}."""
        requests = scheduler_output.scheduled_requests
        if not requests:
            return {}
        manager = self.scheduler.kv_cache_manager
        block_ids = [manager.get_block_ids(r.request_id) for r in requests]
        tokens = self.model_runner.execute_model(scheduler_output, block_ids)
        return {r.request_id: int(t) for r, t in zip(requests, tokens)}

    def _process_outputs(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int], finished: list[Request]
    ) -> list[RequestOutput]:
        changed = {r.request_id: r for r in scheduler_output.scheduled_requests if r.request_id in sampled}
        changed.update((r.request_id, r) for r in scheduler_output.finished_requests)
        changed.update((r.request_id, r) for r in finished)
        outputs = []
        self.last_finished_requests = []
        for request in changed.values():
            output = self._output_for(request)
            if output is None:
                continue
            outputs.append(output)
            if output.finished:
                self.last_finished_requests.append(request)
                del self._requests[request.request_id]
        return outputs

    def _output_for(self, request: Request) -> RequestOutput | None:
        """This step's output of one request; a failure here aborts that request alone."""
        try:
            if not request.is_finished and not self.output_processor.has_new_tokens(request):
                return None  # a prefill (or recompute) chunk: nothing to report yet
            stop = self.output_processor.detokenize(request)
            if stop is not None and not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.stop_reason = stop
            return self.output_processor.make_output(request)
        except Exception:
            logger.exception("request %s failed while processing its output; aborting it",
                             request.request_id)
            if not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            self.output_processor.make_output(request)
            self._requests.pop(request.request_id, None)
            return None
