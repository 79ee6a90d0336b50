"""vLLM's LoRARequest: which adapter a request runs with."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: `lora_name` names it (the server's model name for it), `lora_int_id`
    (>= 1) identifies it to the engine (two requests with the same id share its slot and their
    prefix-cache blocks), `lora_path` is a local PEFT adapter directory. `base_model_name` is
    what the server lists as its parent."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a local adapter directory, got {self.lora_path!r}")


def parse_lora_module(value: str) -> LoRARequest:
    """--lora-modules' item: `name=path`, or JSON {"name", "path"[, "base_model_name"]}
    (vLLM's two forms); the id is set when the server adds it."""
    if value.lstrip().startswith("{"):
        fields = json.loads(value)
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields):
            raise ValueError(f'a JSON LoRA module needs "name" and "path", got {value!r}')
        return LoRARequest(fields["name"], 1, fields["path"], fields.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"a LoRA module is name=path or JSON, got {value!r}")
    return LoRARequest(name, 1, path)
