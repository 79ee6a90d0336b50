"""Seed-OSS (SeedOssForCausalLM: ByteDance's Seed-OSS-36B) on Llama's modules (models/llama.py),
read as HF's modeling_seed_oss.py runs it: Llama's blocks with their own switches for the
q/k/v biases (`attention_bias`, on by default) and the o_proj one (`attention_out_bias`)."""

from __future__ import annotations

from jvllm.models.llama import LlamaForCausalLM

# What SeedOssConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "attention_bias": True,
    "attention_out_bias": False,
}


class SeedOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        biases = {name: cfg.pop(name) for name in ("attention_bias", "attention_out_bias")}
        for name, value in biases.items():
            if value is not True and value is not False:
                raise ValueError(f"{name} must be true or false, got {value!r}")
        cfg = LlamaForCausalLM.normalize_hf_config(cfg)  # without Llama's o_proj bias rule
        cfg["attention_bias"] = biases["attention_bias"]
        if biases["attention_out_bias"]:
            cfg["options"] = {**cfg.get("options", {}), "o_proj_bias": True}
        return cfg
