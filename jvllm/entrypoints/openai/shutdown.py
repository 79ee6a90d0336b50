"""Graceful shutdown (vLLM's --shutdown-timeout): on SIGTERM or SIGINT the server stops taking
requests (the listening socket closes; the API and /health answer 503), lets those in flight run
for up to `shutdown_timeout` seconds, then aborts the rest (their responses end with
finish_reason "abort" and, streamed, with `data: [DONE]`), and returns: the process exits 0.
A second signal stops at once."""

from __future__ import annotations

import asyncio
import time

import uvicorn
from fastapi import FastAPI

from jvllm.logger import init_logger

logger = init_logger(__name__)

# After the abort, how long the aborted responses get to reach their clients before uvicorn
# cancels what is left.
_ABORT_GRACE_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server over an app of `build_app`, shutting down as this module says."""

    def __init__(self, app: FastAPI, shutdown_timeout: float = 0.0, **config_kwargs):
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        grace = shutdown_timeout + _ABORT_GRACE_SECONDS
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace, **config_kwargs))
        self._app = app
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler, which would also note the signal to raise it again once
        stopped (the process would then die of it rather than exit 0)."""
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Drain, from any thread; a second request (or one before serving) stops at once."""
        if self._drain_task is not None or self._loop is None:
            self.force_exit = self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Begin the shutdown; on the server's event loop."""
        if self._drain_task is not None:
            return
        admission = self._app.state.admission
        admission.is_draining = True
        logger.info(
            "shutting down: %d requests in flight get %.0f s to finish",
            admission.num_in_flight,
            self.shutdown_timeout,
        )
        self._drain_task = asyncio.ensure_future(self._abort_after_timeout(admission))
        self.should_exit = True  # uvicorn closes the listener and waits for open requests

    async def _abort_after_timeout(self, admission) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while admission.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.num_in_flight:
            logger.warning(
                "shutdown timeout (%.0f s) reached: aborting %d requests",
                self.shutdown_timeout,
                admission.num_in_flight,
            )
            self._app.state.engine.abort_all()
