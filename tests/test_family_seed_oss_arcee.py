"""Seed-OSS and Arcee (AFM) through the engine against HF transformers: Seed-OSS's separate
switches for the q/k/v and o_proj biases, Arcee's ungated ReLU-squared MLP; their configs as the
hub's checkpoints ship them."""

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

TINY = {**TINY_SHAPES, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_seed_oss_with_both_biases_decodes_like_hf(tmp_path):
    config = transformers.SeedOssConfig(**TINY, attention_out_bias=True)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_seed_oss_defaults_bias_q_k_v_only_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.SeedOssConfig(**TINY))
    config, _ = assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])
    assert config.attention_bias and not config.option("o_proj_bias", False)


def test_arcee_relu2_mlp_decodes_like_hf(tmp_path):
    config = transformers.ArceeConfig(**TINY)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_arcee_with_mlp_biases_matches_hf_logits(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.ArceeConfig(**TINY, mlp_bias=True))
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


# Seed-OSS-36B-Instruct's and AFM-4.5B's config.json, fields trimmed.
SEED_OSS_36B = {
    "architectures": ["SeedOssForCausalLM"],
    "model_type": "seed_oss",
    "attention_bias": True,
    "attention_out_bias": False,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 80,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rope_theta": 10000000.0,
    "vocab_size": 155136,
}
AFM_4_5B = {
    "architectures": ["ArceeForCausalLM"],
    "model_type": "arcee",
    "hidden_size": 2560,
    "intermediate_size": 18432,
    "num_attention_heads": 20,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 20.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "vocab_size": 128004,
}


def test_the_released_configs_read_as_they_mean():
    seed = model_config_from_hf(SEED_OSS_36B, "bfloat16")
    assert (seed.head_dim, seed.rope_theta, seed.attention_bias) == (128, 1e7, True)
    assert not seed.option("o_proj_bias", False)
    afm = model_config_from_hf(AFM_4_5B, "bfloat16")
    assert afm.hidden_act == "relu2" and afm.head_dim == 128
    assert afm.max_position_embeddings == 20 * 4096
    with pytest.raises(ValueError, match="attention_out_bias must be true or false"):
        model_config_from_hf({**SEED_OSS_36B, "attention_out_bias": 1}, "bfloat16")
