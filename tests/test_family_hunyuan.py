"""Hunyuan dense (HunYuanDenseV1ForCausalLM) through the engine against HF transformers: q/k norms
after rope, biases on every attention projection, and the checkpoints' "dynamic" rope with an
alpha (static NTK scaling of the base); its config as the hub's checkpoints ship it."""

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
NTK_ALPHA = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


def test_hunyuan_with_ntk_alpha_rope_decodes_like_hf(tmp_path):
    config = transformers.HunYuanDenseV1Config(**TINY, rope_parameters=NTK_ALPHA)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_hunyuan_with_attention_biases_matches_hf_logits(tmp_path):
    config = transformers.HunYuanDenseV1Config(**TINY, attention_bias=True)
    ours, _ = assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])
    assert ours.qk_norm and ours.option("qk_norm_after_rope")


# Hunyuan-7B-Instruct's config.json, fields trimmed.
HUNYUAN_7B = {
    "architectures": ["HunYuanDenseV1ForCausalLM"],
    "model_type": "hunyuan_v1_dense",
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
    "rope_theta": 10000.0,
    "vocab_size": 128167,
}


def test_the_released_config_reads_its_ntk_alpha_base():
    config = model_config_from_hf(HUNYUAN_7B, "bfloat16")
    assert abs(config.rope_theta - 10000.0 * 1000.0 ** (128 / 126)) < 1e-3 * config.rope_theta
    assert config.rope_scaling is None and config.num_kv_heads == 8
