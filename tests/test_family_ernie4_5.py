"""ERNIE 4.5 (the dense 0.3B, and the MoE models) through the engine against HF transformers:
rotary embeddings over the whole head with GLM's interleaved pairing, and `use_bias` on every
projection; the MoE's softmax router with its correction bias and shared experts; their
configs as the hub's checkpoints ship them."""

import re

import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {**TINY_SHAPES, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_ernie4_5_with_biases_decodes_like_hf(tmp_path):
    config = transformers.Ernie4_5Config(**TINY, use_bias=True, tie_word_embeddings=False)
    hf_model = save_random_model(tmp_path, config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS)


def test_ernie4_5_without_biases_logits_match_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.Ernie4_5Config(**TINY))
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


# ERNIE-4.5-0.3B-PT's config.json, fields trimmed.
ERNIE4_5_0_3B = {
    "architectures": ["Ernie4_5ForCausalLM"],
    "model_type": "ernie4_5",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_hidden_layers": 18,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "rope_theta": 500000,
    "tie_word_embeddings": True,
    "use_bias": False,
    "vocab_size": 103424,
}


def test_ernie4_5_config_reads_its_rope_and_biases():
    config = model_config_from_hf(ERNIE4_5_0_3B, "bfloat16")
    assert config.is_rope_interleaved and config.head_dim == 128 and config.tie_word_embeddings
    assert not config.attention_bias and not config.option("mlp_bias", False)
    assert config.rope_theta == 500000
    untold = {k: v for k, v in ERNIE4_5_0_3B.items() if k not in ("rope_theta", "head_dim")}
    assert model_config_from_hf(untold, "bfloat16").rope_theta == 500000  # its default_theta
    biased = model_config_from_hf({**ERNIE4_5_0_3B, "use_bias": True}, "bfloat16")
    assert biased.attention_bias and biased.option("mlp_bias") and biased.option("o_proj_bias")
    with pytest.raises(ValueError, match="use_bias must be true or false"):
        model_config_from_hf({**ERNIE4_5_0_3B, "use_bias": "yes"}, "bfloat16")


def _ernie4_5_moe(**kwargs) -> transformers.Ernie4_5_MoeConfig:
    """A 3-layer ERNIE 4.5 MoE: a dense layer, then MoE layers of the top 3 of 8 experts and
    two shared ones. Its router's correction bias is a parameter, so save_random_model makes it
    random (large enough to change which experts are chosen)."""
    fields = {
        **TINY,
        "num_hidden_layers": 3,
        "moe_num_experts": 8,
        "moe_k": 3,
        "moe_intermediate_size": 48,
        **kwargs,
    }
    return transformers.Ernie4_5_MoeConfig(**fields)


def test_ernie4_5_moe_decodes_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, _ernie4_5_moe(tie_word_embeddings=False))
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_ernie4_5_moe_without_dense_layers_or_shared_experts_logits_match_hf(tmp_path):
    config = _ernie4_5_moe(moe_layer_start_index=0, moe_num_shared_experts=0)
    hf_model = save_random_model(tmp_path, config)
    config, _ = assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])
    assert config.option("num_dense_layers", 0) == 0 and not config.shared_expert_intermediate_size


# ERNIE-4.5-21B-A3B-PT's config.json, fields trimmed.
ERNIE4_5_21B_A3B = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "num_attention_heads": 20,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 1536,
    "moe_k": 6,
    "moe_layer_interval": 1,
    "moe_layer_start_index": 1,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "rope_theta": 500000,
    "tie_word_embeddings": True,
    "use_bias": False,
    "vocab_size": 103424,
}


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"moe_layer_interval": 2}, "moe_layer_interval=2 are not supported"),
        ({"moe_layer_end_index": 20}, "moe_layer_end_index=20"),
        ({"use_bias": True}, "use_bias=True is not supported"),
        ({"moe_k": 65}, "moe_k must be in [1, moe_num_experts=64]"),
    ],
)
def test_ernie4_5_moe_config_reads_its_layout_and_refuses_others(fields, message):
    config = model_config_from_hf(ERNIE4_5_21B_A3B, "bfloat16")
    assert config.head_dim == 128 and config.is_rope_interleaved
    assert config.num_experts == 64 and config.num_experts_per_tok == 6
    assert config.shared_expert_intermediate_size == 2 * 1536
    assert config.option("num_dense_layers") == 1 and config.option("routing") == "softmax_biased"
    with pytest.raises(ValueError, match=re.escape(message)):
        model_config_from_hf({**ERNIE4_5_21B_A3B, **fields}, "bfloat16")
