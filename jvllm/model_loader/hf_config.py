"""An HF `config.json` read into a ModelConfig: the family's normalisation, then the fields.

Here rather than in config.py, so that config.py (which the layers and families import) imports
no model: the family that reads a config is found through the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jvllm.config import ModelConfig
from jvllm.models.registry import BASE_MODELS, architecture_of, check_supported, model_class
from jvllm.rope_config import parse_rope


def model_config_from_hf(hf_config: Mapping[str, Any] | Any, dtype: str) -> ModelConfig:
    """Build from an HF `config.json` dict or a `transformers.PretrainedConfig`.

    Reads both the transformers 4 layout (`rope_theta`, `rope_scaling` at the top level) and
    the transformers 5 one (`rope_parameters` holding theta and scaling).
    """
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    architecture = architecture_of(cfg)
    check_supported(architecture, cfg.get("model_type"))
    # The family's checks, its defaults and its names in the layout read below.
    cfg = normalize_hf_config(architecture, cfg)
    rope = parse_rope(cfg)

    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    layer_types = cfg.get("layer_types")
    max_len = cfg.get("max_position_embeddings", 2048)
    if rope.scaling is not None:
        max_len = rope.scaling.context_length(max_len)
    return ModelConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope_scaling=rope.scaling,
        max_position_embeddings=max_len,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias")),
        qk_norm=bool(cfg.get("qk_norm")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        dtype=dtype,
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=cfg.get("sliding_window"),
        layer_types=tuple(layer_types) if layer_types else None,
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
        local_rope_theta=rope.local_theta,
        partial_rotary_factor=rope.rotary_fraction,
        is_rope_interleaved=bool(cfg.get("is_rope_interleaved")),
        num_experts=cfg.get("num_local_experts") or cfg.get("num_experts") or 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
        kv_planes=cfg.get("kv_planes", 2),
        options=tuple(sorted(cfg.get("options", {}).items())),
    )


def normalize_hf_config(architecture: str, hf_config: dict) -> dict:
    """The family's reading of its config.json: its checks, its defaults, its field names put
    in the layout model_config_from_hf reads (Llama's), and its own settings under "options"."""
    cfg = dict(hf_config)
    cfg.pop("kv_planes", None)  # the cache's layout is the family's to choose (MLA's latent)
    if (cfg.get("architectures") or [None])[0] in BASE_MODELS:  # families read the causal LM's
        cfg["architectures"] = [architecture, *cfg["architectures"][1:]]
    return model_class(architecture).normalize_hf_config(cfg)
