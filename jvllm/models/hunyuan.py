"""Hunyuan dense (HunYuanDenseV1ForCausalLM: Tencent's Hunyuan-0.5B to 7B) on Llama's modules
(models/llama.py), read as HF's modeling_hunyuan_v1_dense.py runs it: Llama's blocks with per-head
q/k RMSNorms (query_layernorm, key_layernorm) applied after rope, not before, and the
checkpoints' "dynamic" rope with an `alpha`, which is static NTK scaling: the base becomes
theta * alpha^(H / (H - 2)), H the head's width."""

from __future__ import annotations

from jvllm.models.llama import LlamaForCausalLM

# What HunYuanDenseV1Config assumes where a config.json says nothing.
_DEFAULTS = {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2}


def _ntk_alpha(cfg: dict) -> dict:
    """The rope dicts with a "dynamic" type and an alpha as the default type over the scaled
    base (HF's compute_ntk_alpha_rope_parameters)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(cfg.get(key) or {})
        if rope.get("rope_type", rope.get("type")) != "dynamic" or not rope.get("alpha"):
            continue
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        base = float(theta) * float(rope["alpha"]) ** (head_dim / (head_dim - 2))
        cfg[key] = {"rope_type": "default", "rope_theta": base}
        cfg["rope_theta"] = base
    return cfg


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    qk_norm_names = ("self_attn.query_layernorm", "self_attn.key_layernorm")

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = _ntk_alpha({**_DEFAULTS, **cfg})
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)
        cfg["qk_norm"] = True
        cfg["options"] = {**cfg.get("options", {}), "qk_norm_after_rope": True}
        return cfg
