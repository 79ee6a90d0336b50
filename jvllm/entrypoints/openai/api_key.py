"""The server's API key (--api-key, or VLLM_API_KEY): a request to a keyed route without
`Authorization: Bearer <key>` is refused with a 401."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from jvllm.entrypoints.openai.protocol import OpenAIError

# Paths that need the API key when the server has one. vLLM leaves /invocations, /score and
# /rerank open; here they run the same work as their /v1 routes, so they are closed the same way.
_KEYED_PATHS = ("/v1", "/v2", "/invocations", "/score", "/rerank")


class ApiKeyMiddleware:
    """401 on /v1/* and /invocations without `Authorization: Bearer <key>` (health, metrics and
    the tokenizer routes stay open, as in vLLM)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"].startswith(_KEYED_PATHS)
            and scope["method"] != "OPTIONS"
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                error = OpenAIError(
                    "Invalid or missing API key: pass `Authorization: Bearer <key>`.",
                    status_code=401,
                    code="invalid_api_key",
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
