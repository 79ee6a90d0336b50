"""LoRA adapters served beside the base model (docs/design.md "LoRA adapters")."""

from jvllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
