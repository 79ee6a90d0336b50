"""Load an HF checkpoint directory (config.json + *.safetensors) into our fused layout."""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import SUPPORTED_DTYPES, ModelConfig
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.models.llama import LayerParams, Params

DTYPE_CHOICES = ("auto", *SUPPORTED_DTYPES)
_XLA_CPU_ALIGNMENT = 64  # what a host buffer needs for XLA:CPU to use it in place


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


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """np.empty aligned for XLA:CPU: jax.device_put of such an array on CPU uses its buffer in
    place, where an unaligned one (NumPy's big arrays start 16 bytes past a page) is copied, at
    a fraction of NumPy's copy speed (BENCHMARKS.md, "Model loading")."""
    dtype = np.dtype(dtype)
    num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(num_bytes + _XLA_CPU_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _XLA_CPU_ALIGNMENT
    return raw[start : start + num_bytes].view(dtype).reshape(shape)


def _to_device(x: np.ndarray, dtype: Any) -> jax.Array:
    """x as a jax array of `dtype`, through one host copy (the cast) and no device copy on CPU."""
    out = _aligned_empty(x.shape, dtype)
    out[...] = x
    return jax.device_put(out, may_alias=True)


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
        out = _aligned_empty((config.num_layers, rows, *first[0].shape[1:]), out_dtype)
        for i, prefix in enumerate(layer_prefixes):
            np.concatenate([get(prefix + n) for n in names], axis=0, out=out[i], casting="unsafe")
        return jax.device_put(out, may_alias=True)

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
        embed=_to_device(get("model.embed_tokens.weight"), dtype),  # [V, D]
        layers=layers,
        final_norm=_to_device(get("model.norm.weight"), jnp.float32),  # [D]
        lm_head=(
            None
            if config.tie_word_embeddings
            else _to_device(get("lm_head.weight"), dtype)  # [V, D]
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
        tensors.update(read_safetensors(file))

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: checkpoint has no tensor {name!r}")
        return tensors[name]

    return config, fuse_hf_weights(config, get)
