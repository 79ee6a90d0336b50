"""AsyncLLM: an `LLMEngine` driven by a background thread while requests come and go.

The engine thread owns the engine: it applies queued commands (add, abort) between steps, runs
`step()` while anything is unfinished and sleeps otherwise. After each step it hands that step's
outputs to the event loop of each request in one `call_soon_threadsafe` call; everything after
that (metrics, delta/cumulative shaping, JSON) runs on the event loop, off the step loop.

A consumer that falls behind skips outputs, never tokens: the engine reports cumulative outputs
and each stream keeps only the latest one, from which `generate()` cuts the deltas it yields.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.data_parallel import DataParallelEngine, make_engine, replicas
from jvllm.engine.input_processor import PromptType
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.mm_processor import ProcessedPrompt
from jvllm.engine.output_shaper import OutputShaper
from jvllm.engine.request_stream import PoolingStream, RequestStream
from jvllm.engine.stat_logger import LoggingStatLogger, SchedulerStats, scheduler_stats
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput
from jvllm.pooling_outputs import PoolingRequestOutput
from jvllm.pooling_params import PoolingParams
from jvllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the engine was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The engine refused a request at admission: `max_waiting_requests` already wait."""


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
        # Requests the engine holds before one more must wait past the bound (DP: all replicas).
        self._max_admitted = None
        if max_waiting_requests is not None:
            num_slots = sum(r.engine_config.scheduler_config.max_num_seqs for r in replicas(engine))
            self._max_admitted = num_slots + max_waiting_requests
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.stat_loggers = list(stat_loggers or [])
        self.stats = self._snapshot()  # the engine may have run before: steps count from here
        self._stat_logger = LoggingStatLogger() if log_stats else None
        if self._stat_logger is not None:  # counting starts now, not at the first step's end
            self._stat_logger.maybe_log(self._snapshot(), time.monotonic())
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._live: dict[str, RequestStream] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name="jvllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """vLLM's constructor: the engine `engine_args` describe (data parallel included)."""
        return cls(make_engine(**dataclasses.asdict(engine_args)))

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return self._dead is not None

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
        self._submit(("add", stream, prompt, sampling_params, priority, lora_request, added))
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
                self._submit(("abort", stream))

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
        self._submit(("add", stream, prompt, pooling_params, priority, None, added))
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
                self._submit(("abort", stream))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (vLLM's): their KV blocks are freed and each one's `generate()` ends
        with "abort", after the tokens its consumer had not read; unknown ids are ignored."""
        is_iterable = isinstance(request_id, Iterable)
        ids = [request_id] if isinstance(request_id, str) or not is_iterable else list(request_id)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a str or an iterable of str, got {request_id!r}")
        for i in ids:
            self._submit(("abort_id", i))

    async def call_engine(self, fn):
        """fn(engine) run on the engine thread between steps -> its result (vLLM's
        collective_rpc, in one process): how the server sleeps and wakes the engine."""
        done = concurrent.futures.Future()
        self._submit(("call", fn, done))
        return await asyncio.wrap_future(done)

    def abort_all(self) -> None:
        """Abort every unfinished request (a server's shutdown once its drain time is over)."""
        self._submit(("abort_all",))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests get an `EngineDeadError`."""
        self._shutdown = True
        self._wakeup.set()
        for replica in replicas(self.engine):
            replica.model_runner.compiler.cancel_compiles()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running: {self._dead!r}")

    # ---- engine thread ----

    def _submit(self, command: tuple) -> None:
        if self._dead is not None or self._shutdown:
            if command[0] in ("add", "call"):
                command[-1].set_exception(
                    EngineDeadError(f"the engine is not running: {self._dead}")
                )
            return
        self._commands.append(command)
        self._wakeup.set()
        if self._dead is not None and command[0] in ("add", "call"):
            # The loop stopped while we queued: fail this future here (the engine thread owns
            # the rest of the state and fails everything else on its way out).
            try:
                command[-1].set_exception(
                    EngineDeadError(f"the engine is not running: {self._dead}")
                )
            except concurrent.futures.InvalidStateError:
                pass  # the engine thread got to it first

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._shutdown:
                if self._apply_commands():
                    self.stats = self._snapshot()  # an abort may have left the engine idle
                if not engine.has_unfinished_requests():
                    self._idle()
                    continue
                outputs = engine.step()
                self._dispatch(outputs)
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log(self.stats, time.monotonic())
        except BaseException as e:  # an engine bug: every request learns of it, nothing hangs
            logger.exception("the engine loop died")
            self._dead = e
        finally:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            try:  # leave the engine clean for whoever holds it next
                self.engine.abort_request(list(self._live))
            except Exception:
                logger.exception("could not abort the requests left in the engine")
            self._fail_all(self._dead)

    def _idle(self) -> None:
        """Wait for a command; with log_stats, wake every interval to log the quiet too."""
        if self._stat_logger is None:
            self._wakeup.wait()
        elif not self._wakeup.wait(self._stat_logger.interval):
            self.stats = self._snapshot()
            self._stat_logger.maybe_log(self.stats, time.monotonic())
        self._wakeup.clear()

    def _apply_commands(self) -> bool:
        """Apply the queued commands; whether there were any."""
        engine = self.engine
        had_commands = bool(self._commands)
        while self._commands:
            command = self._commands.popleft()
            op = command[0]
            if op == "add":
                _, stream, prompt, params, priority, lora_request, added = command
                if not added.set_running_or_notify_cancel():
                    continue
                if self._is_full():
                    added.set_exception(
                        EngineOverloadedError(
                            f"{self.max_waiting_requests} requests are already waiting "
                            "(max_waiting_requests); retry later"
                        )
                    )
                    continue
                try:
                    engine.add_request(
                        stream.request_id,
                        prompt,
                        params,
                        priority=priority,
                        lora_request=lora_request,
                    )
                except Exception as e:  # noqa: BLE001 - the caller's bad input reaches that caller only
                    added.set_exception(e)
                    continue
                self._live[stream.request_id] = stream
                added.set_result(None)
            elif op == "abort":  # from the stream itself: only if it is still that stream's
                stream = command[1]
                if self._live.get(stream.request_id) is stream:
                    del self._live[stream.request_id]
                    engine.abort_request(stream.request_id)
                    self._record_aborted(stream)
            elif op == "abort_id":
                stream = self._live.pop(command[1], None)
                if stream is not None:
                    engine.abort_request(command[1])
                    self._record_aborted(stream)
                    stream.call_on_loop(stream.abort)
            elif op == "call":
                _, fn, done = command
                if not done.set_running_or_notify_cancel():
                    continue
                try:
                    done.set_result(fn(engine))
                except Exception as e:  # noqa: BLE001 - the caller's refusal reaches that caller only
                    done.set_exception(e)
            elif op == "abort_all":
                engine.abort_request(list(self._live))
                for stream in self._live.values():
                    self._record_aborted(stream)
                    stream.call_on_loop(stream.abort)
                self._live.clear()
        return had_commands

    def _record_aborted(self, stream: RequestStream) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record_aborted(stream)

    def _is_full(self) -> bool:
        if self._max_admitted is None:
            return False
        return self.engine.get_num_unfinished_requests() >= self._max_admitted

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        pairs = []
        for output in outputs:
            stream = self._live.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._live[output.request_id]
            pairs.append((stream, output))
        lost = [s for rid, s in self._live.items() if not self._engine_has(rid)]
        for stream in lost:  # the engine dropped it (its output processing failed)
            del self._live[stream.request_id]
            error = RuntimeError(
                f"request {stream.request_id} failed in the engine and was aborted"
            )
            stream.call_on_loop(stream.fail, error)
        before, self.stats = self.stats, self._snapshot()
        self._record_step(before, self.stats)
        self._deliver_many(pairs, now)

    def _record_step(self, before: SchedulerStats, after: SchedulerStats) -> None:
        num_tokens = (after.num_prompt_tokens - before.num_prompt_tokens) + (
            after.num_generation_tokens - before.num_generation_tokens
        )
        if num_tokens > 0:  # a step that computed nothing (all waiting on grammars) is no step
            for stat_logger in self.stat_loggers:
                stat_logger.record_step(num_tokens)

    def _engine_has(self, request_id: str) -> bool:
        """Whether the engine still knows the request (or, with n > 1, its children)."""
        return self.engine.has_request(request_id)

    def _snapshot(self) -> SchedulerStats:
        return scheduler_stats(replicas(self.engine))

    def _deliver_many(self, pairs: list[tuple[RequestStream, RequestOutput]], now: float) -> None:
        """One wake-up per event loop per step; the loop puts outputs and records metrics."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, output in pairs:
            by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._on_loop, items, now)
            except RuntimeError:  # that loop is closed: its consumers are gone
                pass

    def _on_loop(self, items: list[tuple[RequestStream, RequestOutput]], now: float) -> None:
        generated = [(s, o) for s, o in items if isinstance(o, RequestOutput)]  # not pooled
        for stat_logger in self.stat_loggers:
            stat_logger.record(generated, now)
        for stream, output in items:
            stream.put(output)

    def _fail_all(self, error: BaseException) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add" and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(EngineDeadError(str(error)))
        for stream in self._live.values():
            stream.call_on_loop(stream.fail, EngineDeadError(f"the engine loop stopped: {error!r}"))
        self._live.clear()
