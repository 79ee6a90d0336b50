"""A request's mailbox between AsyncLLM's engine thread and the request's event loop."""

from __future__ import annotations

import asyncio

from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import SamplingParams


class _Mailbox:
    """What every request's mailbox has: its identity and arrival, the event its consumer waits
    on, and the engine thread's ways of ending it early."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, arrival: float):
        self.request_id = request_id
        self.loop = loop
        self.arrival_time = arrival
        self.aborted = False
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def abort(self) -> None:
        self.aborted = True
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def call_on_loop(self, fn, *args) -> None:
        """fn(*args) on the consumer's event loop, from the engine thread; nothing where that
        loop is closed (its consumer is gone)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass


class RequestStream(_Mailbox):
    """One request's mailbox on its event loop. Outputs the consumer has not taken yet are merged
    (per completion index, the latest cumulative one wins), so a slow consumer skips outputs,
    never completions or tokens."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        arrival: float,
        sampling_params: SamplingParams,
    ):
        super().__init__(request_id, loop, arrival)
        self.sampling_params = sampling_params  # for the metrics (n, max_tokens)
        self.header: RequestOutput | None = None  # the latest output, for its request fields
        self.pending: dict[int, CompletionOutput] = {}
        self.finished = False
        # Metrics bookkeeping (event loop side): tokens seen per completion index.
        self.num_tokens_seen: dict[int, int] = {}
        self.last_token_time: float | None = None

    def put(self, output: RequestOutput) -> None:
        self.header = output
        for completion in output.outputs:
            self.pending[completion.index] = completion
        self.finished = self.finished or output.finished
        self.ready.set()

    def take(self) -> tuple[RequestOutput | None, list[CompletionOutput]]:
        changed = [self.pending[i] for i in sorted(self.pending)]
        self.pending = {}
        return self.header, changed


class PoolingStream(_Mailbox):
    """A pooling request's mailbox: it gets one output, its last (AsyncLLM.encode)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, arrival: float):
        super().__init__(request_id, loop, arrival)
        self.output = None  # the PoolingRequestOutput

    def put(self, output) -> None:
        self.output = output
        self.ready.set()
