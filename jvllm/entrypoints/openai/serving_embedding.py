"""/v1/embeddings (OpenAI's body and response, vLLM's extras) over an engine started with
runner="pooling", and the guard that answers each runner's routes on the other's server."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi.responses import JSONResponse

from jvllm.entrypoints.chat import has_images, render_conversation
from jvllm.entrypoints.openai.engine_errors import engine_errors, param_of
from jvllm.entrypoints.openai.protocol import OpenAIError, _Request
from jvllm.entrypoints.openai.serving_engine import OpenAIServing
from jvllm.pooling_params import PoolingParams

# Score's and rerank's (serving_score.py, which embeds through this module's engine calls).
SCORE_ROUTES = ("/score", "/v1/score")
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
# The routes that generate, refused on a pooling server, and those that pool, refused on a
# generating one.
_GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
_EMBEDDING_ROUTES = ("/v1/embeddings", *SCORE_ROUTES, *RERANK_ROUTES)


class EmbeddingRequest(_Request):
    model: str | None = None
    # str | list[str] | list[int] | list[list[int]], checked in `prompts`; or, vLLM's chat
    # embedding request, `messages` (one prompt under the tokenizer's chat template).
    input: Any = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False  # vLLM's defaults for a chat embedding request
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


# What an error's message may name (engine_errors.param_of); a message naming none is the input's.
# The fields an engine error may name: a prompt's, "input" (encode_all adds "messages" for a
# chat embedding request, whose prompt came in it).
_FIELDS = tuple(f for f in EmbeddingRequest.model_fields if f != "messages")


def prompts(value) -> list[str | list[int]]:
    """OpenAI's `input` as a list of prompts (texts or token id lists); OpenAIError naming
    `input` for anything else."""
    is_one_token_list = isinstance(value, list) and value and all(map(_is_token, value))
    if isinstance(value, str) or is_one_token_list:
        value = [value]
    if not isinstance(value, list) or not value:
        raise OpenAIError(
            "input must be a non-empty string, a list of strings, a list of token ids or a "
            "list of token id lists",
            param="input",
        )
    for i, item in enumerate(value):
        is_tokens = isinstance(item, list) and all(_is_token(t) for t in item)
        if not (isinstance(item, str) or is_tokens) or not item:
            raise OpenAIError(
                f"input[{i}] must be a non-empty string or list of token ids, got {item!r}"[:200],
                param="input",
            )
    return value


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(data: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes (what OpenAI's client
    decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(data.astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest) -> dict:
        if self.check_model(request.model) is not None:
            raise OpenAIError("LoRA adapters do not serve embeddings", param="model")
        if (request.input is None) == (request.messages is None):
            raise OpenAIError("pass exactly one of input and messages", param="input")
        if request.messages is not None:
            inputs = [self._chat_prompt(request)]
        else:
            inputs = prompts(request.input)
        try:
            params = PoolingParams(
                request.dimensions, request.normalize, request.truncate_prompt_tokens
            )
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e), _FIELDS) or "input") from None
        request_id = f"embd-{uuid.uuid4().hex}"
        prompt_field = "input" if request.messages is None else "messages"
        outputs = await self.encode_all(inputs, params, request_id, prompt_field)
        data = [
            {
                "object": "embedding",
                "embedding": _encode(output.outputs.data, request.encoding_format),
                "index": i,
            }
            for i, output in enumerate(outputs)
        ]
        num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name,
            "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
        }

    def _chat_prompt(self, request: EmbeddingRequest) -> list[int]:
        """A chat embedding request's conversation as token ids, under the tokenizer's chat
        template (special tokens as the template writes them, as in vLLM)."""
        if not request.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        if has_images(request.messages):
            raise OpenAIError("image parts are not embedded", param="messages")
        try:
            rendered = render_conversation(
                self.tokenizer,
                request.messages,
                None,
                request.add_generation_prompt and not request.continue_final_message,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
        except Exception as e:  # noqa: BLE001 - no template, or one the messages break
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        return rendered["prompt_token_ids"]

    async def encode_all(
        self, inputs, params: PoolingParams, request_id: str, prompt_field: str = "input"
    ) -> list:
        """Every prompt as its own engine request, side by side; the first failure cancels
        the others (which aborts them); an error about a prompt names `prompt_field`."""
        fields = _FIELDS if prompt_field == "input" else (*_FIELDS, prompt_field)
        tasks = [
            asyncio.ensure_future(self.engine.encode(p, params, f"{request_id}-{i}"))
            for i, p in enumerate(inputs)
        ]
        try:
            with engine_errors(fields, default=prompt_field):
                outputs = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        for output in outputs:
            if output.outputs is None:
                raise OpenAIError(
                    f"request {output.request_id} was aborted",
                    status_code=500,
                    type="internal_server_error",
                )
        return outputs


class RunnerRoutes:
    """ASGI middleware: on a pooling server the generating routes answer 400, on a generating
    server /v1/embeddings, /v1/score and /v1/rerank do, each saying what the server is and
    how to start the other."""

    def __init__(self, app, runner: str):
        self.app = app
        self.runner = runner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            message = _wrong_runner(scope["path"], self.runner)
            if message is not None:
                body = OpenAIError(message).body()
                await JSONResponse(body, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _wrong_runner(path: str, runner: str) -> str | None:
    if runner == "pooling" and path in _GENERATE_ROUTES:
        return (
            f"{path} generates text, and this server's model is an embedding model (started "
            "with --runner pooling): use /v1/embeddings, /v1/score or /v1/rerank"
        )
    if runner != "pooling" and path in _EMBEDDING_ROUTES:
        return (
            f"{path} needs an embedding model: start the server with --runner pooling "
            "(this one generates)"
        )
    return None
