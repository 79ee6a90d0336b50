"""The names a server answers to: the base model's (--served-model-name) and its LoRA
adapters' (--lora-modules, and those loaded at run time), as vLLM's OpenAIServingModels.

A request's `model` picks the base model or an adapter; /v1/models lists both, each adapter
with the base model as its `parent`.
"""

from __future__ import annotations

import os
import uuid

from jvllm.entrypoints.openai.protocol import OpenAIError
from jvllm.lora.request import LoRARequest

# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class ServedModels:
    def __init__(self, names: str | list[str], adapters: list[LoRARequest] | None = None):
        self.names = [names] if isinstance(names, str) else list(names)
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        for adapter in adapters or []:
            self.add(adapter.lora_name, adapter.lora_path, adapter.base_model_name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a name
        this server does not serve."""
        if model is None or model in self.names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            names = ", ".join(f"`{name}`" for name in [*self.names, *self.adapters])
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves {names}.",
                status_code=404,
                param="model",
                type="not_found_error",
                code="model_not_found",
            )
        return adapter

    def reply_name(self, model: str | None) -> str:
        """The `model` a reply carries: the adapter's name it asked for, else the base's first."""
        return model if model in self.adapters else self.names[0]

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at `path` as `name` (a ValueError if the name is taken)."""
        if name in self.names or name in self.adapters:
            raise ValueError(f"the model name {name!r} is already served")
        adapter = LoRARequest(name, self._next_id, path, base_model_name or self.names[0])
        self._next_id += 1
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is served")
        return self.adapters.pop(name)

    def cards(self, created: int, root: str, max_model_len: int) -> list[dict]:
        """/v1/models' entries: the base model's names, then the adapters."""
        entries = [(name, root, None) for name in self.names] + [
            (a.lora_name, a.lora_path, a.base_model_name) for a in self.adapters.values()
        ]
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jvllm",
                "root": card_root,
                "parent": parent,
                "max_model_len": max_model_len,
                # vLLM's cards carry OpenAI's legacy `permission` list, which clients written
                # against it read.
                "permission": [_permission(created)],
            }
            for name, card_root, parent in entries
        ]


def _permission(created: int) -> dict:
    """A /v1/models card's `permission` entry, with vLLM's values."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def runtime_lora_updating() -> bool:
    """Whether the load/unload routes are open (vLLM's environment switch)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true")
