"""AsyncLLM: an `LLMEngine` driven by a background thread while requests come and go.

Each call here becomes a command for the engine thread (engine_thread.py), which alone touches
the engine; a request's outputs come back to its event loop through its `RequestStream`.

A consumer that falls behind skips outputs, never tokens: the engine reports cumulative outputs
and each stream keeps only the latest one, from which `generate()` cuts the deltas it yields.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.data_parallel import DataParallelEngine, make_engine, replicas
from jvllm.engine.engine_thread import EngineDeadError, EngineOverloadedError, EngineThread
from jvllm.engine.input_processor import PromptType
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.mm_processor import ProcessedPrompt
from jvllm.engine.output_shaper import OutputShaper
from jvllm.engine.request_stream import PoolingStream, RequestStream
from jvllm.engine.stat_logger import SchedulerStats
from jvllm.outputs import RequestOutput
from jvllm.pooling_outputs import PoolingRequestOutput
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import RequestOutputKind, SamplingParams

# The errors are the engine thread's; callers catch them from here, beside the API that raises them.
__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError"]


class AsyncLLM:
    """vLLM's async engine API: `generate()` streams `RequestOutput`s, `abort()` ends a request.

    `stat_loggers` have `record(items, now)`, called on the event loop with each step's
    `(stream, output)` pairs, and `record_step(num_tokens)` and `record_aborted(stream)`, called
    on the engine thread (see `jvllm.engine.metrics`). `stats` is the latest `SchedulerStats`,
    taken after every step and every batch of adds and aborts, so it reads 0 running when idle.
    With `log_stats`, the engine thread logs throughput and load every few seconds (stat_logger.py).
    `max_waiting_requests` (None: no bound) is how many requests may wait beyond the
    `max_num_seqs` that run; a request past it fails at once with `EngineOverloadedError`.
    """

    def __init__(
        self,
        engine: LLMEngine | DataParallelEngine,
        stat_loggers: list[Any] | None = None,
        log_stats: bool = False,
        max_waiting_requests: int | None = None,
    ):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(
                f"max_waiting_requests must be >= 0 or None (no bound), got {max_waiting_requests}"
            )
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.stat_loggers = list(stat_loggers or [])
        self._engine_thread = EngineThread(
            engine, self.stat_loggers, log_stats, max_waiting_requests
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """vLLM's constructor: the engine `engine_args` describe (data parallel included)."""
        return cls(make_engine(**dataclasses.asdict(engine_args)))

    @property
    def stats(self) -> SchedulerStats:
        return self._engine_thread.stats

    @property
    def is_running(self) -> bool:
        return self._engine_thread.is_running

    @property
    def errored(self) -> bool:
        return self._engine_thread.dead is not None

    def get_tokenizer(self):
        return self.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        output_kind: RequestOutputKind | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add the request and yield its outputs as they come; the last one has `finished`.

        `output_kind` (default: `sampling_params.output_kind`, else CUMULATIVE) picks what each
        output holds: everything so far, only what is new (DELTA), or only the final output.
        Invalid input raises here (ValueError/TypeError) before anything is yielded. Leaving the
        generator early (break, cancellation, a client gone) aborts the request.
        `lora_request`: the LoRARequest it runs with (enable_lora=True), None for the base
        model; `priority` (vLLM's): lower first, under scheduling_policy="priority".
        """
        kind = RequestOutputKind(
            output_kind if output_kind is not None else sampling_params.output_kind
        )
        if sampling_params.output_kind != RequestOutputKind.CUMULATIVE:
            # The engine always reports cumulative outputs; shaping happens here.
            sampling_params = dataclasses.replace(
                sampling_params, output_kind=RequestOutputKind.CUMULATIVE
            )
        stream = RequestStream(
            request_id, asyncio.get_running_loop(), time.monotonic(), sampling_params
        )
        shaper = OutputShaper(kind)
        prompt = await self._process_images(prompt)
        added = concurrent.futures.Future()
        self._engine_thread.submit(
            ("add", stream, prompt, sampling_params, priority, lora_request, added)
        )
        finished = False
        try:
            await asyncio.wrap_future(added)
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    finished = True  # the engine has already let go of it
                    raise stream.error
                header, changed = stream.take()
                if stream.aborted:
                    finished = True
                    yield shaper.abort(header, changed, request_id)
                    return
                finished = stream.finished
                shaped = shaper.shape(header, changed, finished)
                if shaped is not None:
                    yield shaped
        finally:
            if not finished:
                self._engine_thread.submit(("abort", stream))

    async def _process_images(self, prompt: PromptType) -> PromptType:
        """A prompt with images, run through the model's processor in a thread of its own, not
        on the engine's (it takes milliseconds an image, which every stream would wait for):
        its multi_modal_data becomes the ProcessedPrompt that add_request takes as is."""
        engine = replicas(self.engine)[0]
        images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if engine.mm_processor is None or not images or isinstance(images, ProcessedPrompt):
            return prompt
        processed = await asyncio.to_thread(engine.mm_processor.process, prompt, engine.tokenizer)
        return {**prompt, "multi_modal_data": processed}

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """Pool one prompt (an engine with runner="pooling") -> its output, whose `outputs`
        is None if the request was aborted. Invalid input raises before anything runs;
        a caller that stops waiting (cancellation, a client gone) aborts the request."""
        stream = PoolingStream(request_id, asyncio.get_running_loop(), time.monotonic())
        added = concurrent.futures.Future()
        self._engine_thread.submit(("add", stream, prompt, pooling_params, priority, None, added))
        finished = False
        try:
            await asyncio.wrap_future(added)
            await stream.ready.wait()
            finished = True  # the engine has let go of it, whatever came
            if stream.error is not None:
                raise stream.error
            if stream.aborted:
                return PoolingRequestOutput(request_id, None, [], finished=True)
            return stream.output
        finally:
            if not finished:
                self._engine_thread.submit(("abort", stream))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (vLLM's): their KV blocks are freed and each one's `generate()` ends
        with "abort", after the tokens its consumer had not read; unknown ids are ignored."""
        is_iterable = isinstance(request_id, Iterable)
        ids = [request_id] if isinstance(request_id, str) or not is_iterable else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a str or an iterable of str, got {request_id!r}")
        for i in ids:
            self._engine_thread.submit(("abort_id", i))

    async def call_engine(self, fn):
        """fn(engine) run on the engine thread between steps -> its result (vLLM's
        collective_rpc, in one process): how the server sleeps and wakes the engine."""
        done = concurrent.futures.Future()
        self._engine_thread.submit(("call", fn, done))
        return await asyncio.wrap_future(done)

    def abort_all(self) -> None:
        """Abort every unfinished request (a server's shutdown once its drain time is over)."""
        self._engine_thread.submit(("abort_all",))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests get an `EngineDeadError`."""
        self._engine_thread.shutdown(timeout)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._engine_thread.dead!r}")
