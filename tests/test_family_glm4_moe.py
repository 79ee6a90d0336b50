"""GLM-4.5 (Glm4MoeForCausalLM) through the engine against HF transformers: half-head
rotate-half rotary embeddings, q/k/v biases without an o_proj one, dense layers before
DeepSeek-V3's grouped sigmoid router with its correction bias and a shared expert; the MTP
layer the checkpoints keep is left out; its config as the hub's checkpoints ship it."""

import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_with_correction_biases,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {**TINY_SHAPES, "num_hidden_layers": 3, "head_dim": 32, "bos_token_id": 1}
# GLM-4.5's router, small: 8 experts in 4 groups of 2, the best 2 groups, top 3, scaled.
ROUTER = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 1.5,
    "moe_intermediate_size": 48,
}
PROMPTS = ragged_prompts(TINY["vocab_size"], lengths=(5, 17, 40))


def glm4_moe_config(**kwargs) -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(**{**TINY, **ROUTER, "eos_token_id": 2, **kwargs})


def test_glm4_5_like_decodes_like_hf(tmp_path):
    """GLM-4.5's layout: q/k/v biases, one dense layer first, a shared expert."""
    hf_model = save_with_correction_biases(tmp_path, glm4_moe_config(attention_bias=True))
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_qk_norms_unrenormalised_weights_and_no_dense_layer_match_hf_logits(tmp_path):
    hf_config = glm4_moe_config(
        use_qk_norm=True, norm_topk_prob=False, first_k_dense_replace=0, n_shared_experts=2
    )
    hf_model = save_with_correction_biases(tmp_path, hf_config)
    config, _ = assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])
    assert config.option("num_dense_layers", 0) == 0 and config.qk_norm


# GLM-4.5-Air's config.json, fields trimmed.
GLM4_5_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000,
    "routed_scaling_factor": 1.0,
    "topk_group": 1,
    "use_qk_norm": False,
    "vocab_size": 151552,
    "eos_token_id": [151329, 151336, 151338],
}


def test_glm4_5_air_config_reads_its_rotary_biases_and_router():
    config = model_config_from_hf(GLM4_5_AIR, "bfloat16")
    assert config.rotary_dim == 64 and not config.is_rope_interleaved
    assert config.attention_bias and not config.option("o_proj_bias", False)
    assert config.num_experts == 128 and config.shared_expert_intermediate_size == 1408
    assert config.option("num_dense_layers") == 1 and config.option("routing") == "noaux_tc"
    untold = {k: v for k, v in GLM4_5_AIR.items() if k != "partial_rotary_factor"}
    assert model_config_from_hf(untold, "bfloat16").rotary_dim == 64  # Glm4MoeConfig's 0.5
    dense = model_config_from_hf({**GLM4_5_AIR, "first_k_dense_replace": 46}, "bfloat16")
    assert dense.num_experts == 0 and dense.option("num_dense_layers", 0) == 0
    with pytest.raises(ValueError, match="n_group must be a positive int dividing"):
        model_config_from_hf({**GLM4_5_AIR, "n_group": 3}, "bfloat16")
    with pytest.raises(ValueError, match="use_qk_norm must be true or false"):
        model_config_from_hf({**GLM4_5_AIR, "use_qk_norm": "yes"}, "bfloat16")
