"""GPT-BigCode (GPTBigCodeForCausalLM: StarCoder, SantaCoder) through the engine against HF
transformers: GPT-2's layers with Linear weights, multi-query attention (one key and value
head), and without it q/k/v rows head by head; its config as the hub's checkpoints ship it."""

import transformers
from family_parity import (
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 256}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_gpt_bigcode_multi_query_decodes_like_hf(tmp_path):
    config = transformers.GPTBigCodeConfig(**TINY)
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_gpt_bigcode_multi_head_untied_matches_hf_logits(tmp_path):
    config = transformers.GPTBigCodeConfig(**TINY, multi_query=False, tie_word_embeddings=False)
    ours, _ = assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])
    assert ours.num_kv_heads == 4


# starcoderbase-1b's config.json, fields trimmed.
STARCODERBASE_1B = {
    "architectures": ["GPTBigCodeForCausalLM"],
    "model_type": "gpt_bigcode",
    "activation_function": "gelu_pytorch_tanh",
    "multi_query": True,
    "n_embd": 2048,
    "n_head": 16,
    "n_inner": 8192,
    "n_layer": 24,
    "n_positions": 8192,
    "vocab_size": 49152,
}


def test_the_released_config_reads_one_kv_head():
    config = model_config_from_hf(STARCODERBASE_1B, "bfloat16")
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (1, 128, 8192)
    assert config.max_position_embeddings == 8192 and config.tie_word_embeddings
