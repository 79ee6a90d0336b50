"""llama.cpp's architectures as HF ones: each GGUF architecture's HF architecture, its tensor
names, and its metadata read back into an HF config.json dict.

What each reads follows how llama.cpp's converter (convert_hf_to_gguf.py) writes that
architecture and how llama.cpp reads it back where a key is left out (defaults, Gemma 2's and 3's
window patterns and attention scales). gguf.py maps the tensors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jvllm.model_loader.dequantize import dequantize
from jvllm.model_loader.gguf_file import GGUFFile, GGUFTensor
from jvllm.model_loader.gguf_moe import (
    MIXTRAL_EXPERTS,
    QWEN_EXPERTS,
    SHARED_EXPERT,
    read_experts,
    read_qwen_moe,
)

# GGUF per-layer tensor names -> HF names (after "blk.{i}." / "model.layers.{i}.").
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# One norm before the MLP (Llama's naming, which Gemma's HF checkpoints share).
_PRE_NORM = {**_ATTENTION, "ffn_norm.weight": "post_attention_layernorm.weight", **_MLP}
# Gemma 2 and 3: norms before and after the attention and the MLP.
_SANDWICH_NORMS = {
    **_ATTENTION,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **_MLP,
}
_QKV_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# Phi-3 keeps HF's fused q|k|v and gate|up tensors (llama.cpp splits them when it runs).
_PHI3 = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# MoE layers: the router (llama.cpp keeps it in float32); the experts are in gguf_moe.py.
_QWEN_MOE = {
    **_ATTENTION,
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# Llama's names hold Mixtral's too (llama.cpp writes it as a Llama with experts).
_LLAMA = {**_PRE_NORM, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = ("rope_freqs.weight",)  # Llama 3.1's frequency factors
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's
_GELU_TANH = "gelu_pytorch_tanh"  # Gemma's MLP activation (llama.cpp's GELU is the tanh one)
# llama.cpp's Gemma 2 and 3 scale the scores by (D / N)^-1/2 for their 27B models (told apart by
# their layer count) and by H^-1/2 otherwise, as HF's query_pre_attn_scalar does.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's defaults where a Gemma file leaves a key out.
_GEMMA_DEFAULTS = {
    "gemma2": {"sliding_window": 4096, "pattern": 2, "attn_softcap": 50.0, "final_softcap": 30.0},
    "gemma3": {"pattern": 6, "rope_theta_swa": 10000.0},
}


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture: the HF model it holds and how its converter wrote it."""

    hf_architecture: str
    model_type: str
    layer_names: Mapping[str, str]  # GGUF per-layer tensor name -> HF's
    config_tensors: tuple[str, ...] = ()  # tensors read into the config, not the weights
    # Llama's converter reorders each head's q and k rows for llama.cpp's rope (gguf.py undoes
    # it); the other architectures' rope is HF's rotate-half, and their rows stay in HF's order.
    permutes_qk: bool = False
    # Added to every norm weight when read: Gemma's converter stores HF's weight + 1 (its norms
    # scale by 1 + weight, llama.cpp's by the weight).
    norm_shift: float = 0.0
    # The architecture's own metadata (beyond what every one has) into the HF config dict.
    read_config: Callable[[GGUFFile, str, dict[str, Any]], None] | None = None
    # GGUF per-layer 3-D expert tensor name -> HF's name of one expert's, "{}" its index.
    expert_names: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _read_llama(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """llama.cpp's converter writes Mistral and Mixtral as a Llama without its window; a file
    that gives one (`llama.attention.sliding_window`) gets Mistral's window on every layer, and
    one with experts (`llama.expert_count`) is Mixtral (whose experts are intermediate_size
    wide, and whose router always renormalises its top-k weights, as llama.cpp's)."""
    window = gguf.metadata.get(f"{arch}.attention.sliding_window")
    if gguf.metadata.get(f"{arch}.expert_count"):
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral")
        cfg["num_local_experts"], cfg["num_experts_per_tok"] = read_experts(gguf, arch)
        cfg["sliding_window"] = window or None
    elif window:
        cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
        cfg["sliding_window"] = window


def _read_gemma(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """Gemma 1, 2 and 3: the GeLU MLP; Gemma 2's and 3's score scale, windows, soft-caps and
    (Gemma 3) the windowed layers' rope base."""
    meta = gguf.metadata.get
    cfg["hidden_activation"] = _GELU_TANH
    if arch == "gemma":
        return
    defaults = _GEMMA_DEFAULTS[arch]
    is_27b = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // cfg["num_attention_heads"] if is_27b else cfg["head_dim"]
    )
    _read_gemma_windows(gguf, arch, cfg)
    cfg["final_logit_softcapping"] = meta(
        f"{arch}.final_logit_softcapping", defaults.get("final_softcap")
    )
    local_theta = meta(f"{arch}.rope.freq_base_swa", defaults.get("rope_theta_swa"))
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = local_theta
        return
    cfg["attn_logit_softcapping"] = meta(f"{arch}.attn_logit_softcapping", defaults["attn_softcap"])
    if local_theta is not None and local_theta != cfg["rope_theta"]:
        raise ValueError(
            f"GGUF gemma2.rope.freq_base_swa={local_theta} is not supported; supported: none, "
            f"or the global base ({cfg['rope_theta']}), as HF's Gemma 2 has one base"
        )


def _read_gemma_windows(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """Every `pattern`-th layer global, the others windowed (llama.cpp's reading); Gemma 3
    without a window (its converter leaves the key out when HF's pattern is 1): all global."""
    defaults = _GEMMA_DEFAULTS[arch]
    window = gguf.metadata.get(f"{arch}.attention.sliding_window", defaults.get("sliding_window"))
    pattern = gguf.metadata.get(f"{arch}.attention.sliding_window_pattern", defaults["pattern"])
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(
            f"GGUF {arch}.attention.sliding_window_pattern={pattern!r} is not supported; "
            "supported: a period p >= 1 (every p-th layer global, the others windowed)"
        )
    is_windowed = lambda i: bool(window) and (i + 1) % pattern != 0
    cfg["sliding_window"] = window or None
    cfg["layer_types"] = [
        "sliding_attention" if is_windowed(i) else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _read_phi3(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> None:
    """Phi-3: the rotated fraction of each head (Phi-4-mini's 3/4), the window (0: none, as
    the converter writes Phi-4's) and LongRoPE's factor sets, written as tensors."""
    meta = gguf.metadata.get
    head_dim = cfg["head_dim"]
    rotary_dim = meta(f"{arch}.rope.dimension_count", head_dim)
    is_even_part = 2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0
    if not is_even_part or int(head_dim * (rotary_dim / head_dim)) != rotary_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rotary_dim} is not supported; supported: an even "
            f"number from 2 to {head_dim} (head_dim) of each head's first dims"
        )
    cfg["partial_rotary_factor"] = rotary_dim / head_dim
    cfg["sliding_window"] = meta(f"{arch}.attention.sliding_window") or None
    original = meta(f"{arch}.rope.scaling.original_context_length")
    if original:
        cfg["original_max_position_embeddings"] = original
    if "rope_factors_long.weight" not in gguf.tensors:
        return
    rope = {
        "rope_type": "longrope",
        "long_factor": _factors(gguf.tensors["rope_factors_long.weight"]),
        "short_factor": _factors(gguf.tensors["rope_factors_short.weight"]),
    }
    if meta(f"{arch}.rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = meta(f"{arch}.rope.scaling.attn_factor")
    cfg["rope_scaling"] = rope


def _factors(tensor: GGUFTensor) -> list[float]:
    return dequantize(tensor.data, tensor.qtype, tensor.shape).reshape(-1).tolist()


ARCHITECTURES = {
    "llama": GGUFArchitecture(
        "LlamaForCausalLM",
        "llama",
        _LLAMA,
        _ROPE_FREQS,
        True,
        read_config=_read_llama,
        expert_names=MIXTRAL_EXPERTS,
    ),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", {**_PRE_NORM, **_QKV_BIASES}),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", {**_PRE_NORM, **_QK_NORMS}, _ROPE_FREQS),
    "gemma": GGUFArchitecture(
        "GemmaForCausalLM", "gemma", _PRE_NORM, norm_shift=-1.0, read_config=_read_gemma
    ),
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", "gemma2", _SANDWICH_NORMS, norm_shift=-1.0, read_config=_read_gemma
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**_SANDWICH_NORMS, **_QK_NORMS},
        norm_shift=-1.0,
        read_config=_read_gemma,
    ),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "phi3", _PHI3, _LONGROPE, read_config=_read_phi3),
    "qwen3moe": GGUFArchitecture(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        {**_QWEN_MOE, **_QK_NORMS},
        read_config=read_qwen_moe,
        expert_names=QWEN_EXPERTS,
    ),
    "qwen2moe": GGUFArchitecture(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        {**_QWEN_MOE, **SHARED_EXPERT, **_QKV_BIASES},
        read_config=read_qwen_moe,
        expert_names=QWEN_EXPERTS,
    ),
}


def architecture_of(gguf: GGUFFile, path: str) -> tuple[str, GGUFArchitecture]:
    """The file's `general.architecture` and what it maps to, or a ValueError naming those
    supported."""
    arch = gguf.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {list(ARCHITECTURES)}"
        )
    return arch, ARCHITECTURES[arch]


def hf_config_of(gguf: GGUFFile, path: str) -> dict[str, Any]:
    """The HF config.json dict the file's metadata describes."""
    arch, spec = architecture_of(gguf, path)
    meta = gguf.metadata.get
    num_heads = meta(f"{arch}.attention.head_count")
    hidden_size = meta(f"{arch}.embedding_length")
    head_dim = meta(f"{arch}.attention.key_length", hidden_size // num_heads)
    if meta(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"{path}: GGUF {arch}.attention.value_length="
            f"{meta(f'{arch}.attention.value_length')} is not supported; supported: equal to "
            f"key_length ({head_dim})"
        )
    cfg = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": meta(f"{arch}.vocab_size") or len(meta("tokenizer.ggml.tokens")),
        "hidden_size": hidden_size,
        "intermediate_size": meta(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta(f"{arch}.context_length", 2048),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id"),
        "dtype": "float32",
    }
    if spec.read_config is not None:
        spec.read_config(gguf, arch, cfg)
    _read_rope(gguf, arch, cfg, path)
    return cfg


def _yarn(meta, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """HF's YaRN rope_scaling from llama.cpp's keys: the factor, the original context (else the
    file's context length), the ramp's betas where given, and llama.cpp's attn_factor, which
    multiplies the cos/sin scale YaRN computes (HF's attention_factor replaces it)."""
    key = f"{arch}.rope.scaling."
    factor = float(meta(key + "factor", 1.0))
    original = meta(key + "original_context_length") or cfg["max_position_embeddings"]
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for name in ("beta_fast", "beta_slow"):
        if meta(key + "yarn_" + name) is not None:
            rope[name] = float(meta(key + "yarn_" + name))
    if meta(key + "attn_factor") is not None and factor > 1:
        rope["attention_factor"] = float(meta(key + "attn_factor")) * (0.1 * math.log(factor) + 1)
    return rope


def _read_rope(gguf: GGUFFile, arch: str, cfg: dict[str, Any], path: str) -> None:
    """The rope's extent and scaling that every architecture may carry (Phi-3's own in
    _read_phi3)."""
    meta = gguf.metadata.get
    rotary_dim = meta(f"{arch}.rope.dimension_count", cfg["head_dim"])
    if arch != "phi3" and rotary_dim != cfg["head_dim"]:
        raise ValueError(
            f"{path}: GGUF rope over {rotary_dim} of each head's {cfg['head_dim']} dims is not "
            "supported; supported: rope over the whole head (a part of it: phi3 files)"
        )
    scaling = meta(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = float(meta(f"{arch}.rope.scaling.factor", 1.0))
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling == "yarn":
        cfg["rope_scaling"] = _yarn(meta, arch, cfg)
    elif scaling == "longrope" and "rope_scaling" in cfg:  # Phi-3's factor tensors
        pass
    elif scaling != "none":
        raise ValueError(
            f"{path}: GGUF rope scaling {scaling!r} is not supported; supported: 'none', "
            "'linear', 'yarn', Llama 3.1's frequency factors (rope_freqs.weight) and Phi-3's "
            "LongRoPE factors (rope_factors_long/short.weight)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        cfg["rope_scaling"] = _rope_freqs(gguf.tensors["rope_freqs.weight"], cfg)


def _rope_freqs(tensor: GGUFTensor, cfg: dict[str, Any]) -> dict[str, Any]:
    """HF's rope_scaling for llama.cpp's rope_freqs f32[H/2]: one divisor of each rotation
    frequency, as its converter writes Llama 3.1's scaling (Llama 3.1-3.3 files). Those are
    longrope's divisors with a single set and no cos/sin scale."""
    factors = np.asarray(_factors(tensor))
    if factors.shape[0] != cfg["head_dim"] // 2 or not np.all(factors > 0):
        raise ValueError(
            f"rope_freqs.weight must hold head_dim / 2 = {cfg['head_dim'] // 2} positive "
            f"divisors, got {factors.shape[0]} values (min {factors.min()})"
        )
    divisors = [float(f) for f in factors]
    return {
        "rope_type": "longrope",
        "short_factor": divisors,
        "long_factor": divisors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": cfg["max_position_embeddings"],
    }
