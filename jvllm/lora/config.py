"""LoRA serving's engine options and requests, checked at the edge."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jvllm.config import ModelConfig
from jvllm.lora.request import LoRARequest


def check_lora_args(args) -> None:
    """ValueError naming the EngineArgs field that LoRA serving cannot take."""
    if not isinstance(args.enable_lora, bool):
        raise ValueError(  # noqa: TRY004 - every bad engine option is a ValueError (vLLM)
            f"enable_lora must be a bool, got {args.enable_lora!r}"
        )
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    cpu = args.max_cpu_loras
    if cpu is not None and (
        not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < args.max_loras
    ):
        raise ValueError(
            f"max_cpu_loras must be None or an int >= max_loras ({args.max_loras}), got {cpu!r}"
        )
    if not args.enable_lora:
        return
    if args.runner == "pooling":
        raise ValueError("enable_lora=True serves generating models; runner='pooling' is not")


def adapter_config(config: ModelConfig, args) -> ModelConfig:
    """The model config the runner builds: with args' adapter slots where enable_lora."""
    if not args.enable_lora:
        return config
    return dataclasses.replace(config, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


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


def adapter_reader(engine) -> Callable[[LoRARequest], object]:
    """A check of an adapter against `engine`'s model (an LLMEngine or its data-parallel front
    end) that reads it as the engine will and keeps nothing, safe off the engine's thread."""
    from jvllm.engine.data_parallel import replicas  # the engine package imports this module

    slots = replicas(engine)[0].model_runner.adapters
    if slots is None:
        raise ValueError("LoRA adapters need an engine started with enable_lora=True")
    return slots.read
