"""The Llama family (Llama, Mistral, Qwen2, Qwen3) through the engine against HF transformers."""

import pytest
import transformers
from family_parity import (
    assert_hf_window_cuts,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


def test_mistral_sliding_window_decodes_like_hf(tmp_path):
    """Mistral's window (8 positions, pages of 4) cuts the long prompts, their decodes and the
    prefix hit, whose first pages fall wholly outside it."""
    config = transformers.MistralConfig(**TINY, sliding_window=8, attn_implementation="eager")
    hf_model = save_random_model(tmp_path, config)
    prompts = ragged_prompts(TINY["vocab_size"])
    assert_hf_window_cuts(hf_model, max(prompts, key=len))
    assert_matches_hf(tmp_path, hf_model, prompts, block_size=4)
