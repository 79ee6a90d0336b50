"""MiniMax-M2 (MiniMaxM2ForCausalLM) through the engine against HF transformers: q/k norms over
all heads, rotary on part of each head, sigmoid routing with a correction bias over Mixtral-named
experts; its config as the hub's checkpoint ships it."""

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

TINY = {
    **TINY_SHAPES,
    "head_dim": 32,
    "intermediate_size": 48,  # each expert's
    "num_local_experts": 8,
    "num_experts_per_tok": 3,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS = ragged_prompts(TINY["vocab_size"], lengths=(5, 17, 40))


def test_minimax_m2_like_decodes_like_hf(tmp_path):
    """MiniMax-M2's layout: rotary on the first half of each head (rotary_dim)."""
    hf_model = save_with_correction_biases(
        tmp_path, transformers.MiniMaxM2Config(**TINY, rotary_dim=16)
    )
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_rotary_over_whole_heads_matches_hf_logits(tmp_path):
    hf_model = save_with_correction_biases(tmp_path, transformers.MiniMaxM2Config(**TINY))
    config, _ = assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])
    assert config.rotary_dim == 32


# MiniMax-M2's config.json, fields trimmed.
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "head_dim": 128,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "qk_norm_type": "per_layer",
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


def test_minimax_m2_config_reads_its_rotary_and_router():
    config = model_config_from_hf(MINIMAX_M2, "bfloat16")
    assert config.rotary_dim == 64 and not config.qk_norm and config.rope_theta == 5e6
    assert config.num_experts == 256 and config.moe_intermediate_size == 1536
    assert config.option("routing") == "noaux_tc" and config.norm_topk_prob
    assert not config.shared_expert_intermediate_size
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        model_config_from_hf({**MINIMAX_M2, "scoring_func": "softmax"}, "bfloat16")
