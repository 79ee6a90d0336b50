"""Process 0's engine when the engine spans several processes (distributed/multihost.py).

An LLMEngine that records what enters it (requests added, aborted) and broadcasts the record
with each step, so that every worker process applies the same changes and steps alongside. It is
its own `peers` (engine/sleep.py): sleep, wake_up, load_weights and reset_prefix_cache go to the
workers the same way, right away.
"""

from __future__ import annotations

import atexit
import time
import weakref

from jvllm.distributed.multihost import broadcast_commands
from jvllm.engine.input_processor import PromptType
from jvllm.engine.llm_engine import LLMEngine
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams


class LeaderEngine(LLMEngine):
    def __init__(self, model: str | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self._pending: list[tuple] = []
        self._stopped = False
        self.peers = self  # the workers mirror this engine: sleep and the like go to them too
        # At exit (before jax.distributed shuts down: its hook was registered first).
        ref = weakref.ref(self)
        atexit.register(lambda: (engine := ref()) and engine.stop_workers())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None:
        arrival_time = time.time() if arrival_time is None else arrival_time
        # Raises before anything is sent.
        super().add_request(request_id, prompt, params, arrival_time, priority, lora_request)
        command = ("add", request_id, prompt, params, arrival_time, priority, lora_request)
        self._pending.append(command)

    def abort_request(self, request_id: str | list[str]) -> None:
        super().abort_request(request_id)
        self._pending.append(("abort", request_id))

    def step(self) -> list[RequestOutput]:
        self._send(("step",))
        return super().step()

    def num_unfinished_elsewhere(self) -> int:
        return 0  # the workers hold this engine's requests

    def announce(self, call: str, *args) -> None:
        self._send((call, *args))

    def stop_workers(self) -> None:
        """Let the workers end (once; later steps would wait for them forever)."""
        if not self._stopped:
            self._stopped = True
            self._send(("stop",))

    def _send(self, last: tuple) -> None:
        if self._stopped and last[0] != "stop":
            raise WorkersLostError("the worker processes were stopped; start every process anew")
        commands, self._pending = [*self._pending, last], []
        try:
            broadcast_commands(commands)
        except Exception as e:
            self._stopped = True
            raise WorkersLostError(
                "a worker process stopped answering (it exited, crashed or lost its "
                f"connection): {type(e).__name__}: {e}. The engine cannot go on without it; "
                "restart every process"
            ) from e


class WorkersLostError(RuntimeError):
    """Process 0 can no longer reach a worker process: the multi-process engine is over."""
