"""The engine thread: the one thread that drives `AsyncLLM`'s engine while requests come and go.

It owns the engine: it applies queued commands (add, abort, call) between steps, runs `step()`
while anything is unfinished and sleeps otherwise. After each step it hands that step's outputs
to the event loop of each request in one `call_soon_threadsafe` call; everything after that
(metrics, delta/cumulative shaping, JSON) runs on the event loop, off the step loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from typing import Any

from jvllm.engine.data_parallel import DataParallelEngine, replicas
from jvllm.engine.llm_engine import LLMEngine
from jvllm.engine.request_stream import RequestStream
from jvllm.engine.stat_logger import LoggingStatLogger, SchedulerStats, scheduler_stats
from jvllm.logger import init_logger
from jvllm.outputs import RequestOutput

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the engine was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The engine refused a request at admission: `max_waiting_requests` already wait."""


class EngineThread:
    """Runs `engine` on a daemon thread, started here; other threads only `submit()` commands.

    A command is a tuple: ("add", stream, prompt, params, priority, lora_request, added),
    ("abort", stream), ("abort_id", request_id), ("call", fn, done) or ("abort_all",), where
    `added` and `done` are `concurrent.futures.Future`s that the thread settles.
    `stats` is the latest `SchedulerStats`; `dead` is None while the loop may run, then why it
    stopped. `stat_loggers` is the owner's list, read at each use, so a logger appended later
    records too.
    """

    def __init__(
        self,
        engine: LLMEngine | DataParallelEngine,
        stat_loggers: list[Any],
        log_stats: bool,
        max_waiting_requests: int | None,
    ):
        self.engine = engine
        self.stat_loggers = stat_loggers
        self.max_waiting_requests = max_waiting_requests
        # Requests the engine holds before one more must wait past the bound (DP: all replicas).
        self._max_admitted = None
        if max_waiting_requests is not None:
            num_slots = sum(r.engine_config.scheduler_config.max_num_seqs for r in replicas(engine))
            self._max_admitted = num_slots + max_waiting_requests
        self.stats = self._snapshot()  # the engine may have run before: steps count from here
        self._stat_logger = LoggingStatLogger() if log_stats else None
        if self._stat_logger is not None:  # counting starts now, not at the first step's end
            self._stat_logger.maybe_log(self._snapshot(), time.monotonic())
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._live: dict[str, RequestStream] = {}  # engine thread only
        self.dead: BaseException | None = None
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name="jvllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def submit(self, command: tuple) -> None:
        if self.dead is not None or self._shutdown:
            if command[0] in ("add", "call"):
                command[-1].set_exception(
                    EngineDeadError(f"the engine is not running: {self.dead}")
                )
            return
        self._commands.append(command)
        self._wakeup.set()
        if self.dead is not None and command[0] in ("add", "call"):
            # The loop stopped while we queued: fail this future here (the engine thread owns
            # the rest of the state and fails everything else on its way out).
            try:
                command[-1].set_exception(
                    EngineDeadError(f"the engine is not running: {self.dead}")
                )
            except concurrent.futures.InvalidStateError:
                pass  # the engine thread got to it first

    def shutdown(self, timeout: float) -> None:
        """Stop the loop; unfinished requests get an `EngineDeadError`."""
        self._shutdown = True
        self._wakeup.set()
        for replica in replicas(self.engine):
            replica.model_runner.compiler.cancel_compiles()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

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
            self.dead = e
        finally:
            self.dead = self.dead or EngineDeadError("the engine was shut down")
            try:  # leave the engine clean for whoever holds it next
                self.engine.abort_request(list(self._live))
            except Exception:
                logger.exception("could not abort the requests left in the engine")
            self._fail_all(self.dead)

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
