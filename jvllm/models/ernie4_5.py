"""ERNIE 4.5 (Ernie4_5ForCausalLM: the dense ERNIE-4.5-0.3B) on Llama's modules (models/llama.py),
read as HF's modeling_ernie4_5.py runs it: Llama's pre-norm blocks and gated MLP, rotary
embeddings over the whole head interleaved (GLM's pairing: dims 2i, 2i + 1 at frequency i;
layers/rotary.py), and `use_bias` putting a bias on every projection (q/k/v, o, gate/up, down).
"""

from __future__ import annotations

from jvllm.models.llama import LlamaForCausalLM

# What Ernie4_5Config assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_bias": False,
}
_ROPE_THETA = 500_000.0  # Ernie4_5Config's default_theta


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """Llama's modules with ERNIE 4.5's rotary pairing and biases."""

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        if cfg.get("head_dim") is None:  # Ernie4_5Config's fallback
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg["rope_theta"] = _ROPE_THETA
        use_bias = cfg.pop("use_bias")
        if use_bias is not True and use_bias is not False:
            raise ValueError(f"use_bias must be true or false, got {use_bias!r}")
        cfg.update(attention_bias=use_bias, mlp_bias=use_bias, is_rope_interleaved=True)
        return LlamaForCausalLM.normalize_hf_config(cfg)
