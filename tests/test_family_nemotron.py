"""Nemotron (NemotronForCausalLM) through the engine against HF transformers: LayerNorm1P (scaled by
1 + weight), rotary on half of each head, the ungated ReLU-squared MLP, biases where the config
asks; its config as the hub's checkpoints ship it."""

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


def test_nemotron_decodes_like_hf(tmp_path):
    config = transformers.NemotronConfig(**TINY)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_nemotron_with_biases_matches_hf_logits(tmp_path):
    config = transformers.NemotronConfig(**TINY, attention_bias=True, mlp_bias=True)
    assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])


# Nemotron-Mini-4B-Instruct's config.json, fields trimmed.
NEMOTRON_MINI_4B = {
    "architectures": ["NemotronForCausalLM"],
    "model_type": "nemotron",
    "head_dim": 128,
    "hidden_act": "relu2",
    "hidden_size": 3072,
    "intermediate_size": 9216,
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.5,
    "rope_theta": 10000,
    "vocab_size": 256000,
}


def test_the_released_config_reads_its_rotary_and_mlp():
    config = model_config_from_hf(NEMOTRON_MINI_4B, "bfloat16")
    assert config.rotary_dim == 64 and config.hidden_act == "relu2"
    assert config.num_kv_heads == 8 and not config.option("is_gated_mlp")
