"""vLLM's routes that load and unload LoRA adapters while the server runs, open only under
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (as in vLLM: anyone who can reach the server could
otherwise make it read any directory)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.data_parallel import replicas
from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.entrypoints.openai.serving_models import ServedModels
from jvllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def adapter_reader(engine) -> Callable[[LoRARequest], object]:
    """A check of an adapter against `engine`'s model (an LLMEngine or its data-parallel front
    end) that reads it as the engine will and keeps nothing, safe off the engine's thread."""
    slots = replicas(engine)[0].model_runner.adapters
    if slots is None:
        raise ValueError("LoRA adapters need an engine started with enable_lora=True")
    return slots.read


def add_lora_routes(app: FastAPI, engine: AsyncLLM, models: ServedModels) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        if request.lora_name in models.names or request.lora_name in models.adapters:
            raise OpenAIError(
                f"The model name {request.lora_name!r} is already served.", param="lora_name"
            )
        try:
            read = adapter_reader(engine.engine)  # a server without --enable-lora: a 400
            adapter = models.add(request.lora_name, request.lora_path)
            await asyncio.to_thread(read, adapter)  # a bad adapter is refused here, not later
        except ValueError as e:
            models.adapters.pop(request.lora_name, None)
            raise OpenAIError(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        try:
            models.remove(request.lora_name)
        except ValueError as e:
            raise OpenAIError(str(e), status_code=404, param="lora_name") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )
