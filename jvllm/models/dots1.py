"""dots.llm1 (Dots1ForCausalLM: rednote's dots.llm1.base / .inst) on Llama's modules, read as
HF's modeling_dots1.py runs it: Qwen3's attention (per-head q/k norms before rope; biases on
q/k/v and o where `attention_bias`; Qwen2's sliding windows from max_window_layers), and
GLM-4.5's mixture of experts (models/glm4_moe.py: DeepSeek-V3's router and shared experts after
first_k_dense_replace dense layers), its top-k renormalised only where norm_topk_prob."""

from __future__ import annotations

from jvllm.models.glm4_moe import Glm4MoeForCausalLM, read_v3_experts
from jvllm.models.llama import LlamaForCausalLM

# What Dots1Config assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "first_k_dense_replace": 0,
    "sliding_window": 4096,
    "max_window_layers": 62,
}


def _normalize(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    if not cfg.get("layer_types"):  # Dots1Config's: windowed from max_window_layers on
        window, start = cfg["sliding_window"], cfg["max_window_layers"]
        cfg["layer_types"] = [
            "sliding_attention" if window is not None and i >= start else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    if "sliding_attention" not in cfg["layer_types"]:
        cfg["sliding_window"] = None
    cfg = LlamaForCausalLM.normalize_hf_config(read_v3_experts(cfg))
    cfg["qk_norm"] = True
    return cfg


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    normalize_hf_config = staticmethod(_normalize)
