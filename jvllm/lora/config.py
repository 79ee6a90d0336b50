"""LoRA serving's model config and requests, checked at the edge."""

from __future__ import annotations

import dataclasses

from jvllm.config import ModelConfig
from jvllm.core.engine_config import LoRAConfig
from jvllm.lora.request import LoRARequest


def adapter_config(config: ModelConfig, lora_config: LoRAConfig | None) -> ModelConfig:
    """The model config the runner builds: with the adapter slots where LoRA is enabled."""
    if lora_config is None:
        return config
    return dataclasses.replace(
        config, max_loras=lora_config.max_loras, max_lora_rank=lora_config.max_lora_rank
    )


def check_adapter(lora_request, adapters) -> None:
    """A request's `lora_request`: None, or a LoRARequest whose adapter `adapters` (the
    runner's AdapterSlots; None where the engine serves none) reads and accepts."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(
            f"lora_request must be a jvllm.lora.request.LoRARequest or None, got "
            f"{type(lora_request).__name__}"
        )
    if adapters is None:
        raise ValueError(
            f"lora_request {lora_request.lora_name!r} needs an engine started with "
            "enable_lora=True (LLM(..., enable_lora=True), or jvllm serve --enable-lora)"
        )
    adapters.add(lora_request)
