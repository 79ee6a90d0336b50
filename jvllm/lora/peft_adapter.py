"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) read into
the slot layout of layers/lora.py, on the host.

PEFT's module adds scaling * B (A x) to its output, with A [r, I], B [O, r] and scaling
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora; per module from rank_pattern and
alpha_pattern). Here each adapter-taking projection gets, for one slot, A [L, P*R, I] and
B [L, O, P*R]: module j of a fused projection in column block j, zero-padded from r to R
(max_lora_rank), its scaling folded into B.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct

import numpy as np

from jvllm.lora.module_map import ModuleMap
from jvllm.lora.request import LoRARequest
from jvllm.model_loader.safetensors_file import read_safetensors

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# adapter_config.json fields that change what the adapter computes in ways not built here,
# with the value each must have.
_UNSUPPORTED = {
    "use_dora": (False, "DoRA adapters"),
    "fan_in_fan_out": (False, "Conv1D (fan_in_fan_out) adapters"),
    "lora_bias": (False, "LoRA biases"),
    "use_qalora": (False, "QALoRA adapters"),
}
_MUST_BE_EMPTY = (
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "alora_invocation_tokens",
)
# What reading a truncated or malformed safetensors file raises.
_MALFORMED = (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error)


@dataclasses.dataclass(frozen=True)
class HostAdapter:
    """An adapter in one slot's layout: projection path -> (A [L, P*R, I], B [L, O, P*R]) in
    the model dtype; projections it leaves alone are absent (zeros in its slot)."""

    request: LoRARequest
    rank: int  # the largest r of its modules
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(
    request: LoRARequest, modules: ModuleMap, max_lora_rank: int, dtype
) -> HostAdapter:
    """Read and check `request`'s adapter; ValueError naming what is wrong and how to fix it."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    config = _read_config(request.lora_path, where)
    tensors = _read_tensors(request.lora_path, where)
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    max_rank = 0
    for module, (a, b) in _module_tensors(tensors, where).items():
        piece = modules.pieces.get(module)
        if piece is None:
            raise ValueError(_unsupported_module(where, module, modules))
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise ValueError(
                f"{where}: rank {rank} of {module} is above max_lora_rank={max_lora_rank}; "
                f"start the engine with max_lora_rank >= {rank}"
            )
        num_layers, num_rows, num_inputs, num_pieces = modules.projections[piece.path]
        piece_rows = piece.rows.stop - piece.rows.start
        if a.shape != (rank, num_inputs) or b.shape != (piece_rows, rank):
            raise ValueError(
                f"{where}: {module} has lora_A {a.shape} and lora_B {b.shape}; this model "
                f"takes lora_A [r, {num_inputs}] and lora_B [{piece_rows}, r]: is the adapter "
                "for another base model?"
            )
        if piece.path not in weights:
            width = num_pieces * max_lora_rank
            weights[piece.path] = (
                np.zeros((num_layers, width, num_inputs), dtype),
                np.zeros((num_layers, num_rows, width), dtype),
            )
        stack_a, stack_b = weights[piece.path]
        cols = slice(piece.block * max_lora_rank, piece.block * max_lora_rank + rank)
        scaling = _scaling(config, module, rank)
        stack_a[piece.layer, cols] = a.astype(np.float32)
        stack_b[piece.layer, piece.rows, cols] = b.astype(np.float32) * scaling
        max_rank = max(max_rank, rank)
    others = [n for n in tensors if ".lora_A." not in n and ".lora_B." not in n]
    if others:
        raise ValueError(
            f"{where}: tensor {others[0]!r} is not supported; allowed: the lora_A and lora_B "
            "weights of linear modules"
        )
    if not weights:
        raise ValueError(f"{where}: {_WEIGHTS} holds no lora_A / lora_B weights")
    return HostAdapter(request, max_rank, weights)


def _read_config(path: str, where: str) -> dict:
    config_path = os.path.join(path, _CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"{where}: no {_CONFIG} there; a PEFT LoRA adapter directory has one")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except ValueError as e:
        raise ValueError(f"{where}: {_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(  # noqa: TRY004 - a bad adapter is a ValueError, as every refusal here
            f"{where}: {_CONFIG} must hold a JSON object"
        )
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported; allowed: 'LORA'")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported; allowed: 'none'")
    for name, (allowed, what) in _UNSUPPORTED.items():
        if config.get(name, allowed) != allowed:
            raise ValueError(f"{where}: {what} are not supported ({name} must be {allowed})")
    for name in _MUST_BE_EMPTY:
        if config.get(name):
            raise ValueError(
                f"{where}: {name}={config[name]!r} is not supported; allowed: empty (only "
                "lora_A / lora_B weights of linear modules)"
            )
    return config


def _read_tensors(path: str, where: str) -> dict[str, np.ndarray]:
    weights_path = os.path.join(path, _WEIGHTS)
    if not os.path.isfile(weights_path):
        raise ValueError(
            f"{where}: no {_WEIGHTS} there (a .bin adapter must be saved as safetensors first: "
            "PeftModel.save_pretrained(..., safe_serialization=True))"
        )
    try:
        return read_safetensors(weights_path)
    except _MALFORMED as e:
        raise ValueError(
            f"{where}: {_WEIGHTS} is not a readable safetensors file ({e!r})"
        ) from None


def _module_tensors(tensors: dict, where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module name -> (lora_A [r, I], lora_B [O, r])."""
    out = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(_PREFIX).split(".lora_A.")[0]
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None or a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"{where}: {module} needs a 2-D lora_A and lora_B")
        out[module] = (a, b)
    return out


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of `module`: its alpha (alpha_pattern's where a key names it) over its
    rank, or over the rank's square root with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _unsupported_module(where: str, module: str, modules: ModuleMap) -> str:
    kinds = sorted({name.rsplit(".", 1)[-1] for name in modules.pieces})
    why = (
        "its weights are transformed at load"
        if module in modules.refused
        else "it is not a projection that takes adapters"
    )
    return (
        f"{where}: module {module} cannot take a LoRA adapter ({why}); this model's adapters may "
        f"target {kinds}"
    )
