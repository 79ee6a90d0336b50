"""A server in a background thread of this process (tests, notebooks): uvicorn serving an app
of api_server.build_app, stopped the way SIGTERM stops `jvllm serve` (shutdown.py)."""

from __future__ import annotations

import socket
import threading
import time

from fastapi import FastAPI

from jvllm.entrypoints.openai.shutdown import DrainingServer


class ServerThread:
    """uvicorn serving `app` (of `build_app`) from a background thread of this process (tests,
    notebooks); `stop()` shuts it down as SIGTERM does `jvllm serve`."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = 0.0,
    ):
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.server = DrainingServer(
            app, shutdown_timeout, host=host, port=port, log_level="warning"
        )
        self.thread = threading.Thread(target=self.server.run, name="jvllm-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Drain (shutdown.py) and wait up to `timeout` seconds for the server to stop."""
        self.server.request_shutdown()
        self.thread.join(timeout)
