"""How the server answers what a route raises: an OpenAI error body with its status (a request
that fails validation names its field in `param`), and a generation request refused for bad
input or a full queue counted on /metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jvllm.engine.metrics import ServingMetrics
from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.logger import init_logger

logger = init_logger(__name__)

# The routes that generate: a 400 on one of them counts as a rejected request in the metrics.
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")
# Refusals counted by jvllm:num_requests_rejected_total, by status: bad input, a full queue.
_REJECTED_REASONS = {400: "invalid_request", 503: "overloaded"}


def add_error_handlers(app: FastAPI, metrics: ServingMetrics | None) -> None:
    """The app's exception handlers; `metrics` (None: none kept) counts the refusals."""

    def _count_rejected(request: Request, status_code: int) -> None:
        reason = _REJECTED_REASONS.get(status_code)
        if metrics is not None and reason and request.url.path in _GENERATION_PATHS:
            metrics.record_rejected(reason)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        _count_rejected(request, exc.status_code)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        _count_rejected(request, 400)
        message, param = _validation_message(exc)
        return JSONResponse(OpenAIError(message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        error = OpenAIError(
            str(exc.detail),
            status_code=exc.status_code,
            type="not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        error = OpenAIError(
            f"internal server error: {exc!r}", status_code=500, type="internal_server_error"
        )
        return JSONResponse(error.body(), status_code=500)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(_field_path(first.get("loc", ()))) or None
    messages = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors[:5]
    )
    return messages, param


def _field_path(loc: tuple) -> list[str]:
    """An error's location as the request's field path: without FastAPI's leading "body", and
    cut where pydantic names a member of a union (`prompt.list[int].1` is the field `prompt`)."""
    path = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, str) and ("[" in part or part in _UNION_MEMBER_TAGS):
            break
        path.append(str(part))
    return path


# The tags pydantic gives the plain members of a union (str | list[int]: "str", "list[int]").
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
