"""What the server lets in: bodies up to a size, nothing new while it drains, and no request
left running for a client that went away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jvllm.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_BYTES
from jvllm.entrypoints.openai.engine_errors import RETRY_AFTER_SECONDS
from jvllm.entrypoints.openai.protocol import OpenAIError

# The API a draining server refuses (health says 503 too; metrics and the rest still answer).
_REFUSED_WHILE_DRAINING = ("/v1/", "/invocations")


class Admission:
    """The server's admission state, shared by `AdmissionMiddleware` and the shutdown
    (shutdown.py): the body size limit, whether it drains, and the requests in flight."""

    def __init__(self, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        if max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
        self.max_request_body_bytes = max_request_body_bytes
        self.is_draining = False
        self.num_in_flight = 0


class AdmissionMiddleware:
    """413 for a body over the limit, read no further than the limit (before any parsing); 503
    for a generation while the server drains. Counts the HTTP requests in flight."""

    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = self.admission
        if admission.is_draining and scope["path"].startswith(_REFUSED_WHILE_DRAINING):
            error = OpenAIError(
                "the server is shutting down; send the request to another replica",
                status_code=503,
                type="service_unavailable_error",
            )
            retry = {"Retry-After": str(RETRY_AFTER_SECONDS)}
            await _send_error(error, scope, receive, send, retry)
            return
        admission.num_in_flight += 1
        try:
            body = await _read_body(admission.max_request_body_bytes, scope, receive, send)
            if body is None:
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            admission.num_in_flight -= 1


async def _read_body(limit: int, scope, receive, send) -> bytes | None:
    """The whole body, or None when it was refused (413) or the client left."""
    length = dict(scope["headers"]).get(b"content-length", b"")
    if length.isdigit() and int(length) > limit:
        await _send_error(_too_large(int(length), limit), scope, receive, send)
        return None
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        more = message.get("more_body", False)
        if len(body) > limit:  # a chunked body, or one longer than its Content-Length says
            await _send_error(_too_large(len(body), limit), scope, receive, send)
            return None
    return bytes(body)


def _replay(body: bytes, receive):
    """A `receive` that gives the body read already, then what the client sends next (its
    disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def _too_large(num_bytes: int, limit: int) -> OpenAIError:
    return OpenAIError(
        f"the request body has {num_bytes} bytes or more; this server takes at most {limit} "
        "(--max-request-body-bytes)",
        status_code=413,
    )


async def _send_error(error: OpenAIError, scope, receive, send, headers=None) -> None:
    response = JSONResponse(error.body(), status_code=error.status_code, headers=headers)
    await response(scope, receive, send)


async def unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result; if the client goes away first, `work` is cancelled, which aborts its
    engine requests and frees their KV blocks (a streamed response watches on its own once it
    has started)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled (a shutdown past its grace)
        gone.cancel()
        is_left = not task.done()
        if is_left:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if is_left:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
