"""Ministral 3 (Ministral3ForCausalLM) through the engine against HF transformers: YaRN rope and
Llama 4's position-dependent query scaling (tried at short lengths: its original context is
made 8 tokens, so that prompts cross several of its steps); its config as the hub's checkpoints
ship it, alone and as a Mistral 3 text model."""

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

ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.5,
}
TINY = {**TINY_SHAPES, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_ministral3_decodes_like_hf(tmp_path):
    config = transformers.Ministral3Config(**TINY, rope_parameters=ROPE)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_a_beta_of_0_scales_no_query_like_hf(tmp_path):
    rope = {**ROPE, "llama_4_scaling_beta": 0.0}
    config = transformers.Ministral3Config(**TINY, rope_parameters=rope)
    ours, _ = assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])
    assert ours.option("llama4_scaling") is None


# Ministral-3-8B-Instruct-2512's text_config, fields trimmed.
MINISTRAL3_8B_TEXT = {
    "model_type": "ministral3",
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 262144,
    "num_attention_heads": 32,
    "num_hidden_layers": 34,
    "num_key_value_heads": 8,
    "rope_parameters": {**ROPE, "factor": 16.0, "original_max_position_embeddings": 16384},
    "vocab_size": 131072,
}


@pytest.mark.parametrize("as_vlm", [False, True], ids=["text", "mistral3"])
def test_the_released_config_reads_its_rope_and_query_scaling(as_vlm):
    text = {**MINISTRAL3_8B_TEXT, "architectures": ["Ministral3ForCausalLM"]}
    if as_vlm:
        text = {
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "text_config": MINISTRAL3_8B_TEXT,
            "vision_config": {"hidden_size": 1024, "num_attention_heads": 16},
        }
    config = model_config_from_hf(text, "bfloat16")
    assert config.option("llama4_scaling") == (0.5, 16384)
    assert config.rope_scaling is not None and config.rope_theta == 1e6
    assert config.sliding_window is None
