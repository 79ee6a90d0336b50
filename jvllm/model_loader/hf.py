"""Load an HF checkpoint directory (config.json + *.safetensors) into our fused layout."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jvllm.config import DTYPE_CHOICES, ModelConfig
from jvllm.distributed.expert_parallel import expert_parallel_config
from jvllm.distributed.mesh import num_ranks, num_shards
from jvllm.distributed.tensor_parallel import placer
from jvllm.logger import init_logger
from jvllm.model_loader.base_model import stored_name, without_missing_head
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.mxfp4 import packed_names, read_packed
from jvllm.model_loader.quant_config import CheckpointQuantization, checkpoint_quantization
from jvllm.model_loader.quantized_tensors import has_quantized, read_quantized
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.models.model import load_checkpoint_weights
from jvllm.models.registry import model_class
from jvllm.quantization.host_weights import HostQuantized

logger = init_logger(__name__)


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


# vLLM's hf_overrides: config.json keys to replace, or a function of the config dict.
HFOverrides = Mapping[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None


def apply_hf_overrides(hf_config: dict[str, Any], overrides: HFOverrides) -> dict[str, Any]:
    """`hf_config` with the user's `overrides` applied, as vLLM's hf_overrides: a mapping's keys
    replace the config's (a nested config, a dict under a key ending in "_config" such as
    Gemma 3's text_config, is updated key by key rather than replaced; a `rope_parameters`
    drops transformers 4's `rope_scaling` and `rope_theta`, which would win over it); a
    callable takes the config dict and returns the one to use."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        return dict(overrides(dict(hf_config)))
    merged = dict(hf_config)
    if "rope_parameters" in overrides:  # transformers 5's rope layout supersedes 4's keys
        for key in ("rope_scaling", "rope_theta"):
            merged.pop(key, None)
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(value, Mapping):
            merged[key] = apply_hf_overrides(dict(merged.get(key) or {}), value)
        else:
            merged[key] = value
    rope = merged.get("rope_parameters")
    if "rope_theta" in overrides and isinstance(rope, Mapping) and "full_attention" not in rope:
        # A transformers 5 config keeps its base in rope_parameters, which wins over the top
        # level's (where families write their defaults).
        merged["rope_parameters"] = {**rope, "rope_theta": overrides["rope_theta"]}
    return merged


def read_hf_config(path: str, dtype: str = "auto", overrides: HFOverrides = None) -> ModelConfig:
    """The ModelConfig of `path/config.json`, with `overrides` applied."""
    hf_config = read_config_json(path, overrides)
    return model_config_from_hf(hf_config, resolve_dtype(dtype, hf_config))


def read_config_json(path: str, overrides: HFOverrides = None) -> dict[str, Any]:
    """`path/config.json` as it is written, with `overrides` applied."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} is not an HF model directory: it has no config.json")
    with open(config_path) as f:
        return apply_hf_overrides(json.load(f), overrides)


def load_hf_dir(
    path: str,
    dtype: str = "auto",
    mesh=None,
    overrides: HFOverrides = None,
    enable_expert_parallel: bool = False,
) -> tuple[ModelConfig, dict]:
    """Load `path/config.json` (with `overrides` applied) and all `path/*.safetensors` (sharded
    or not), placed on `mesh` (None: JAX's default device; the routed experts whole over it
    where `enable_expert_parallel`, distributed/expert_parallel.py). A base model's checkpoint (no
    wrapper prefix, no LM head) loads too (base_model.py). A pre-quantized checkpoint (its
    config's quantization_config, quant_config.py) keeps its matmul weights packed."""
    hf_config = read_config_json(path, overrides)
    quantization = checkpoint_quantization(hf_config)
    config = model_config_from_hf(hf_config, resolve_dtype(dtype, hf_config))
    config = expert_parallel_config(
        config, num_shards(mesh), enable_expert_parallel, num_ranks(mesh)
    )
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (other formats are not supported)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(read_safetensors(file))
    config = without_missing_head(config, tensors)
    read: set[str] = set()

    def get(name: str) -> np.ndarray:
        name = stored_name(name, tensors)
        packed = None if name in tensors else read_packed(tensors, name)
        if packed is not None:  # MXFP4 (gpt-oss's experts), dequantized here
            read.update(packed_names(name))
            return packed
        if name not in tensors:
            raise ValueError(f"{path}: checkpoint has no tensor {name!r}")
        read.add(name)
        return tensors[name]

    quantized = None
    if quantization is not None:
        quantized = functools.partial(_read_quantized, path, tensors, quantization, read)
        _log_quantization(path, quantization)
    params = load_checkpoint_weights(config, get, placer(config, mesh), quantized=quantized)
    _warn_unread(path, config, [n for n in tensors if n not in read])
    return config, params


def _read_quantized(
    path: str,
    tensors: dict[str, np.ndarray],
    quantization: CheckpointQuantization,
    read: set[str],
    name: str,
) -> HostQuantized | None:
    """The weight `name` ("...q_proj.weight") of a pre-quantized checkpoint in the device
    layout, None where the checkpoint stores it as floats."""
    if not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    if not has_quantized(tensors, module):
        base = module.partition(".")[2]  # a base model's checkpoint (base_model.py)
        if not has_quantized(tensors, base):
            return None
        module = base
    scheme = quantization.scheme_for(module)
    if scheme is None:
        raise ValueError(
            f"{path}: {module!r} is stored quantized, but the checkpoint's quantization_config "
            "gives it no scheme (its targets miss it, or its ignore list names it)"
        )
    weight, names = read_quantized(tensors, module, scheme)
    read.update(names)
    return weight


def _log_quantization(path: str, quantization: CheckpointQuantization) -> None:
    """The checkpoint's format, and what becomes of activations its scheme quantizes: fp8 per
    token on a GPU where an FP8 weight's scale covers whole rows (fp8_weight.py), else the
    model dtype."""
    acts = sorted({s.activations for _, s in quantization.groups if s.activations})
    note = ""
    if acts:
        note = (
            f"; the scheme quantizes activations to {'/'.join(acts)}: jvllm does so (fp8, per "
            "token) on a GPU for FP8 weights with a scale a row, and runs the others with "
            "activations in the model dtype (weight-only)"
        )
    logger.info("%s: %s weights, kept packed%s", path, quantization.describe(), note)
    if quantization.kv_cache_scheme:
        logger.info(
            "%s: the checkpoint's kv_cache_scheme (%s) is not applied: the KV cache stores "
            "what kv_cache_dtype says (kv_cache_dtype='fp8' for one byte a value, with scales "
            "per token)",
            path,
            dict(quantization.kv_cache_scheme),
        )


# Tensors checkpoints carry that no model computes with: rotary tables and attention masks
# saved as buffers, a tied LM head saved anyway, and a multimodal checkpoint's image model (its
# text model is what jvllm runs).
_NEVER_READ = re.compile(
    r"rotary_emb\.inv_freq$|\.attn\.(masked_)?bias$|\.attention\.bias$"
    r"|^(model\.)?(vision_tower|multi_modal_projector)\."
    r"|\.(k|v|q|prob)_scale$"  # a kv_cache_scheme's static scales (_log_quantization)
    r"|^t2d$"  # an EAGLE-3 head's draft vocabulary as a mask, d2t's inverse (vLLM skips it too)
    r"|(^|\.)mtp"  # multi-token-prediction modules under mtp names (ERNIE 4.5's, MiniMax-M2's)
)


def _warn_unread(path: str, config: ModelConfig, names: list[str]) -> None:
    """A warning naming the checkpoint's tensors the model never read: a bias or a norm that
    jvllm's model of the architecture lacks, whose outputs would then differ from HF's."""
    names = [n for n in names if not _NEVER_READ.search(n)]
    # A family's tensors that another part reads (DeepSeek-V3's MTP layer, a draft head).
    read_elsewhere = getattr(model_class(config.architecture), "is_read_elsewhere", None)
    if read_elsewhere is not None:
        names = [n for n in names if not read_elsewhere(config, n)]
    if config.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    if names:
        logger.warning(
            "%s: jvllm's %s does not use %d of the checkpoint's tensors, so its outputs may "
            "differ from the checkpoint's model: %s%s",
            path,
            config.architecture,
            len(names),
            ", ".join(sorted(names)[:8]),
            ", ..." if len(names) > 8 else "",
        )
