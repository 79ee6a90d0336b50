"""vLLM's development routes that RL training loops drive a server with between steps: sleep,
wake up, ask, and reset the prefix cache (engine/sleep.py). Open only under
VLLM_SERVER_DEV_MODE=1, as in vLLM: anyone who can reach the server could otherwise stop it
serving. While the engine sleeps, the routes that need the model answer 503."""

from __future__ import annotations

import os

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.data_parallel import replicas
from jvllm.engine.sleep import SLEEP_TAGS, check_replicas_idle
from jvllm.entrypoints.openai.protocol import OpenAIError

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

# The POST routes a sleeping engine still answers: these, the tokenizer's, and LoRA adapters'
# loading (which reads the adapter on the host).
_AWAKE_NOT_NEEDED = ("/sleep", "/wake_up", "/reset_prefix_cache", "/tokenize", "/detokenize")


def server_dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "") == "1"


def add_sleep_routes(app: FastAPI, engine: AsyncLLM) -> None:
    is_sleeping = lambda: any(e.is_sleeping() for e in replicas(engine.engine))

    async def on_every_replica(call: str, *args, all_idle: bool = False):
        """Run LLMEngine.`call`(*args) on each replica, on the engine thread between steps,
        once every one is idle where `all_idle`; a refusal (requests still running, a bad
        level) is the client's 400."""

        def run(front):
            if all_idle:
                check_replicas_idle(replicas(front), call)
            return [getattr(r, call)(*args) for r in replicas(front)]

        try:
            return await engine.call_engine(run)
        except (ValueError, RuntimeError) as e:
            raise OpenAIError(str(e)) from None

    @app.post("/sleep")
    async def sleep(level: int = 1):
        await on_every_replica("sleep", level, all_idle=True)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):  # noqa: B008 - FastAPI's idiom
        bad = [t for t in tags or () if t not in SLEEP_TAGS]
        if bad:
            raise OpenAIError(f"tags must be among {SLEEP_TAGS}, got {bad}", param="tags")
        await on_every_replica("wake_up", tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def get_is_sleeping():
        return {"is_sleeping": is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not all(await on_every_replica("reset_prefix_cache")):
            raise OpenAIError("requests hold prefix-cache blocks: reset it once they finish")
        return Response(status_code=200)

    app.add_middleware(_RefuseWhileAsleep, is_sleeping=is_sleeping)


class _RefuseWhileAsleep:
    """ASGI middleware: 503 on the routes that need the model while the engine sleeps."""

    def __init__(self, app, is_sleeping) -> None:
        self.app = app
        self.is_sleeping = is_sleeping

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and path not in _AWAKE_NOT_NEEDED
            and not path.endswith("_lora_adapter")
            and self.is_sleeping()
        ):
            error = OpenAIError(
                "the engine is asleep (POST /sleep): POST /wake_up before sending requests",
                status_code=503,
                type="service_unavailable",
            )
            await JSONResponse(error.body(), status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)
