"""The OpenAI-compatible server: FastAPI routes over an `AsyncLLM`, run by uvicorn.

jvllm serve [MODEL] --host 127.0.0.1 --port 8000 [--api-key KEY] [engine options]
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

import jvllm
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.metrics import ServingMetrics
from jvllm.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_BYTES
from jvllm.entrypoints.openai.admission import Admission, AdmissionMiddleware, unless_disconnected
from jvllm.entrypoints.openai.api_key import ApiKeyMiddleware
from jvllm.entrypoints.openai.error_handlers import add_error_handlers
from jvllm.entrypoints.openai.lora_routes import adapter_reader, add_lora_routes
from jvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    ResponsesRequest,
    TokenizeRequest,
)
from jvllm.entrypoints.openai.reasoning import get_reasoning_parser
from jvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jvllm.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    OpenAIServingEmbedding,
    RunnerRoutes,
)
from jvllm.entrypoints.openai.serving_models import ServedModels, runtime_lora_updating
from jvllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from jvllm.entrypoints.openai.serving_score import add_score_routes
from jvllm.entrypoints.openai.shutdown import DrainingServer
from jvllm.entrypoints.openai.sleep_routes import add_sleep_routes, server_dev_mode
from jvllm.entrypoints.openai.tool_parsers import get_tool_parser
from jvllm.logger import init_logger
from jvllm.lora.request import LoRARequest

logger = init_logger(__name__)


def build_app(
    engine: AsyncLLM,
    model_name: str | list[str],
    api_key: str | None = None,
    metrics: ServingMetrics | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    chat_template: str | None = None,
    response_role: str = "assistant",
    reasoning_parser: str | None = None,
    lora_modules: list[LoRARequest] | None = None,
    allowed_origins: Sequence[str] = ("*",),
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name` (or several names, the first in
    responses; vLLM's --served-model-name), and its LoRA adapters `lora_modules` under theirs
    (an engine with enable_lora; more at run time under VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    Pass the `ServingMetrics` that the engine records into (its `stat_loggers`) to expose them on /metrics. A request's own
    `chat_template` is refused unless `trust_request_chat_template` (vLLM's flag).
    `tool_call_parser` (a name in tool_parsers.TOOL_PARSERS) reads the calls out of replies to
    tool_choice "auto" (vLLM's --enable-auto-tool-choice); None refuses "auto". A body over
    `max_request_body_bytes` is a 413 (admission.py). `reasoning_parser` (a name in
    reasoning.REASONING_PARSERS) splits thinking models' replies into reasoning and content.
    Browsers may call it from `allowed_origins` with `allowed_methods` and `allowed_headers`
    ("*": any, vLLM's defaults), and send cookies along with `allow_credentials`."""
    app = FastAPI(title="jvllm", version=jvllm.__version__)
    models = ServedModels(model_name, lora_modules)
    if models.adapters:
        read = adapter_reader(engine.engine)
        for adapter in models.adapters.values():
            read(adapter)  # a bad --lora-modules entry stops the server before it listens
    completion = OpenAIServingCompletion(engine, models)
    parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    chat = OpenAIServingChat(
        engine,
        models,
        trust_request_chat_template,
        parser,
        chat_template,
        response_role,
        get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
    )
    responses = OpenAIServingResponses(chat)
    embedding = OpenAIServingEmbedding(engine, models)
    tokenizer = engine.get_tokenizer()
    created = int(time.time())
    admission = Admission(max_request_body_bytes)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.admission = admission
    app.add_middleware(RunnerRoutes, runner=engine.engine.engine_config.load_config.runner)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(AdmissionMiddleware, admission=admission)  # first to refuse
    # Outermost, so that a preflight is answered before any check and a refusal (401, 413,
    # 503) carries the allow headers a browser needs to read it.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=allowed_origins,
        allow_methods=allowed_methods,
        allow_headers=allowed_headers,
        allow_credentials=allow_credentials,
    )

    add_error_handlers(app, metrics)

    def _respond(result):
        if isinstance(result, Response):  # the client left (unless_disconnected)
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw: Request):
        return _respond(await unless_disconnected(raw, completion.create(request)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
        return _respond(await unless_disconnected(raw, chat.create(request)))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request):
        return _respond(await unless_disconnected(raw, responses.create(request)))

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw: Request):
        return _respond(await unless_disconnected(raw, embedding.create(request)))

    add_score_routes(app, embedding)

    @app.get("/v1/models")
    async def list_models():
        root = engine.engine.engine_config.load_config.model or completion.model_name
        return {"object": "list", "data": models.cards(created, root, engine.max_model_len)}

    if runtime_lora_updating():
        add_lora_routes(app, engine, models)
    if server_dev_mode():
        add_sleep_routes(app, engine)

    @app.post("/invocations")
    async def invocations(raw: Request):
        """SageMaker's route (vLLM's): a chat completion for a body with `messages`, a
        completion for one with `prompt`."""
        try:
            body = await raw.json()
        except ValueError as e:
            raise OpenAIError(f"malformed JSON body: {e}") from None
        kinds = [
            ("messages", ChatCompletionRequest, chat),
            ("prompt", CompletionRequest, completion),
        ]
        for key, model, serving in kinds:
            if isinstance(body, dict) and key in body:
                try:
                    request = model.model_validate(body)
                except ValidationError as e:
                    raise RequestValidationError(e.errors()) from None
                return _respond(await unless_disconnected(raw, serving.create(request)))
        raise OpenAIError(
            "an /invocations body needs `messages` (a chat completion) or `prompt` (a completion)"
        )

    @app.get("/health")
    async def health():
        if not engine.is_running or admission.is_draining:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health check."""
        return await health()

    @app.get("/version")
    async def version():
        return {"version": jvllm.__version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        completion.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("pass exactly one of prompt and messages", param="prompt")
        add_special_tokens = request.add_special_tokens
        if request.messages is not None:
            tokens = chat.render(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                request.chat_template,
                bool(add_special_tokens),
            )
        else:
            add_special_tokens = add_special_tokens is None or add_special_tokens
            tokens = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": engine.max_model_len,
            "token_strs": token_strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        completion.check_model(request.model)
        vocab_size = engine.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param="tokens"
            )
        return {"prompt": tokenizer.decode(request.tokens)}

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def build_server_engine(
    model: str | None,
    served_model_name: str | list[str] | None = None,
    log_stats: bool = True,
    max_waiting_requests: int | None = None,
    metrics_prefix: str = "jvllm",
    **engine_kwargs,
):
    """(AsyncLLM, ServingMetrics, served model names) for `model` with `EngineArgs` keywords;
    the metrics' names start with `metrics_prefix:` ("vllm": vLLM's own names) and carry the
    first served name."""
    from jvllm.engine.data_parallel import make_engine
    from jvllm.engine.metrics import check_metrics_prefix
    from jvllm.model_loader.default_model import DEFAULT_MODEL

    check_metrics_prefix(metrics_prefix)  # before the model loads
    names = served_model_name or [model or DEFAULT_MODEL]
    names = [names] if isinstance(names, str) else list(names)
    # A server listens at once and compiles every bucket in the background: a request waits at
    # most for its own bucket's compile, and none once all are done.
    engine_kwargs.setdefault("compile_all_buckets", True)
    engine_kwargs.setdefault("compile_in_background", True)
    engine = AsyncLLM(
        make_engine(model, **engine_kwargs),
        log_stats=log_stats,
        max_waiting_requests=max_waiting_requests,
    )
    metrics = ServingMetrics(engine, names[0], prefix=metrics_prefix)
    engine.stat_loggers.append(metrics)
    return engine, metrics, names


def run_server(
    model: str | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    log_level: str = "info",
    log_stats: bool = True,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    max_waiting_requests: int | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    shutdown_timeout: float = 0.0,
    metrics_prefix: str = "jvllm",
    chat_template: str | None = None,
    response_role: str = "assistant",
    reasoning_parser: str | None = None,
    lora_modules: list[LoRARequest] | None = None,
    allowed_origins: Sequence[str] = ("*",),
    allowed_methods: Sequence[str] = ("*",),
    allowed_headers: Sequence[str] = ("*",),
    allow_credentials: bool = False,
    **engine_kwargs,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down as shutdown.py says."""
    engine, metrics, names = build_server_engine(
        model,
        served_model_name,
        log_stats,
        max_waiting_requests=max_waiting_requests,
        metrics_prefix=metrics_prefix,
        **engine_kwargs,
    )
    try:
        app = build_app(
            engine,
            names,
            api_key,
            metrics,
            trust_request_chat_template,
            tool_call_parser,
            max_request_body_bytes,
            chat_template,
            response_role,
            reasoning_parser,
            lora_modules,
            allowed_origins,
            allowed_methods,
            allowed_headers,
            allow_credentials,
        )
        server = DrainingServer(app, shutdown_timeout, host=host, port=port, log_level=log_level)
        logger.info("serving %s on http://%s:%d", ", ".join(names), host, port)
        server.run()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    # vLLM's older launch line, `python -m vllm.entrypoints.openai.api_server --model M ...`,
    # takes the flags of `serve`.
    import sys

    from jvllm.entrypoints.cli import main

    main(["serve", *sys.argv[1:]])
