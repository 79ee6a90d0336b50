"""Load an HF checkpoint directory (config.json + *.safetensors) into our fused layout."""

from __future__ import annotations

import glob
import json
import os
import struct
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from jvllm.config import SUPPORTED_DTYPES, ModelConfig
from jvllm.models.llama import LayerParams, Params

# safetensors dtype tags -> NumPy dtypes. jnp.bfloat16 is ml_dtypes' NumPy type, which the
# safetensors NumPy API lacks; that is why this file reads the (simple) format itself.
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": jnp.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
}
DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)


def resolve_dtype(dtype: str, hf_config: Mapping[str, Any]) -> str:
    """Map a user dtype ("auto" | "float32" | "bfloat16") to the model dtype.

    "auto" follows the checkpoint: bfloat16 stays bfloat16; float16 becomes float32 (exact; a
    float16 -> bfloat16 cast would drop 3 mantissa bits), with a warning; anything else float32.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {DTYPE_CHOICES}")
    if dtype != "auto":
        return dtype
    checkpoint_dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if checkpoint_dtype == "bfloat16":
        return "bfloat16"
    if checkpoint_dtype == "float16":
        warnings.warn(
            "float16 checkpoint: running it in float32 (pass dtype='bfloat16' for speed)",
            stacklevel=3,
        )
    return "float32"


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-map every tensor of one .safetensors file (header: u64 length + JSON)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        tensors[name] = data[start:end].view(dtype).reshape(info["shape"])
    return tensors


def fuse_hf_weights(config: ModelConfig, get: Callable[[str], np.ndarray]) -> Params:
    """Build jax Params from HF-named torch-layout ([out, in]) tensors returned by `get(name)`.

    Each stacked field is built in its target dtype one layer at a time, so the host holds at
    most one field of the model at full precision plus one layer's float32 piece.
    """
    dtype = jnp.dtype(config.dtype)
    layer_prefixes = [f"model.layers.{i}." for i in range(config.num_layers)]

    def stacked(names: tuple[str, ...], out_dtype: Any = dtype) -> jnp.ndarray:
        """HF pieces [out_j, (in)] of every layer -> [L, sum(out_j), (in)] in `out_dtype`."""
        first = [get(layer_prefixes[0] + n) for n in names]
        rows = sum(piece.shape[0] for piece in first)
        out = np.empty((config.num_layers, rows, *first[0].shape[1:]), out_dtype)
        for i, prefix in enumerate(layer_prefixes):
            np.concatenate([get(prefix + n) for n in names], axis=0, out=out[i], casting="unsafe")
        return jnp.asarray(out)

    attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    f32 = jnp.float32  # norm weights and biases: tiny, and they feed float32 math
    layers = LayerParams(
        input_norm=stacked(("input_layernorm.weight",), f32),  # [L, D]
        qkv=stacked(tuple(n + ".weight" for n in attn)),  # [L, (N+2K)*H, D]
        qkv_bias=(  # [L, (N+2K)*H]
            stacked(tuple(n + ".bias" for n in attn), f32) if config.attention_bias else None
        ),
        q_norm=stacked(("self_attn.q_norm.weight",), f32) if config.qk_norm else None,  # [L, H]
        k_norm=stacked(("self_attn.k_norm.weight",), f32) if config.qk_norm else None,  # [L, H]
        o=stacked(("self_attn.o_proj.weight",)),  # [L, D, N*H]
        post_attention_norm=stacked(("post_attention_layernorm.weight",), f32),  # [L, D]
        gate_up=stacked(("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # [L, 2F, D]
        down=stacked(("mlp.down_proj.weight",)),  # [L, D, F]
    )
    return Params(
        embed=jnp.asarray(get("model.embed_tokens.weight"), dtype=dtype),  # [V, D]
        layers=layers,
        final_norm=jnp.asarray(get("model.norm.weight"), dtype=jnp.float32),  # [D]
        lm_head=(
            None
            if config.tie_word_embeddings
            else jnp.asarray(get("lm_head.weight"), dtype=dtype)  # [V, D]
        ),
    )


def read_hf_config(path: str, dtype: str = "auto") -> ModelConfig:
    """The ModelConfig of `path/config.json`."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} is not an HF model directory: it has no config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    return ModelConfig.from_hf_config(hf_config, resolve_dtype(dtype, hf_config))


def load_hf_dir(path: str, dtype: str = "auto") -> tuple[ModelConfig, Params]:
    """Load `path/config.json` and all `path/*.safetensors` (sharded or not)."""
    config = read_hf_config(path, dtype)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (other formats are not supported)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(_read_safetensors(file))

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: checkpoint has no tensor {name!r}")
        return tensors[name]

    return config, fuse_hf_weights(config, get)
