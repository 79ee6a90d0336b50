"""Ministral 3 (Ministral3ForCausalLM, and the text model of Mistral 3 checkpoints whose
text_config is "ministral3": Ministral-3-3B / 8B / 14B) on Llama's modules (models/llama.py),
read as HF's modeling_ministral3.py runs it: Mistral's blocks, YaRN rope by default, and Llama
4's attention scaling: after rope each query is scaled by 1 + beta * ln(1 + floor(p / L)), beta
the rope dict's llama_4_scaling_beta and L its original_max_position_embeddings
(llama.query_scaled_attention)."""

from __future__ import annotations

from jvllm.models.llama import LlamaForCausalLM

# What Ministral3Config assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": None,
}
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def normalize_ministral3(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = dict(cfg.get(key) or _DEFAULT_ROPE)
    beta = rope.pop("llama_4_scaling_beta", None)
    rope.pop("max_position_embeddings", None)  # HF's copy of the top-level field
    cfg[key] = rope
    cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
    cfg = LlamaForCausalLM.normalize_hf_config(cfg)
    cfg["architectures"] = ["Ministral3ForCausalLM"]
    if beta:
        length = rope.get("original_max_position_embeddings")
        if not length or length <= 0:
            raise ValueError(
                "rope_parameters.llama_4_scaling_beta needs the rope dict's "
                f"original_max_position_embeddings > 0, got {length!r}"
            )
        cfg["options"] = {**cfg.get("options", {}), "llama4_scaling": (float(beta), length)}
    return cfg


class Ministral3ForCausalLM(LlamaForCausalLM):
    normalize_hf_config = staticmethod(normalize_ministral3)
