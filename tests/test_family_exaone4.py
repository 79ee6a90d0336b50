"""EXAONE 4 through the engine against HF transformers: OLMo 2's post-norm blocks with q/k norms
head by head, windowed layers that rotate and a global one that does not (the 32B's layout), or
no window and every layer rotating (the 1.2B's); and its config as the hub's checkpoints ship
it."""

import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_hf_window_cuts,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {**TINY_SHAPES, "bos_token_id": 1, "eos_token_id": 2, "attn_implementation": "eager"}
WINDOW = 8  # with pages of 4, the long prompts and the prefix hit leave whole pages behind
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_windowed_exaone4_decodes_like_hf(tmp_path):
    """Layer 0 windowed and rotating, layer 1 global without rotary embeddings."""
    config = transformers.Exaone4Config(
        **TINY, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    )
    hf_model = save_random_model(tmp_path, config)
    assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=4)


def test_unwindowed_exaone4_logits_match_hf(tmp_path):
    config = transformers.Exaone4Config(
        **TINY, sliding_window=None, layer_types=["full_attention"] * 2, tie_word_embeddings=True
    )
    hf_model = save_random_model(tmp_path, config)
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


# EXAONE-4.0-32B's config.json, fields trimmed.
EXAONE4_32B = {
    "architectures": ["Exaone4ForCausalLM"],
    "model_type": "exaone4",
    "hidden_size": 5120,
    "intermediate_size": 27392,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "sliding_window_pattern": "LLLG",
    "vocab_size": 102400,
}


def test_exaone4_config_windows_three_layers_of_four_and_rotates_only_those():
    config = model_config_from_hf(EXAONE4_32B, "bfloat16")
    assert config.qk_norm and config.sliding_window == 4096
    windowed = [i % 4 != 3 for i in range(64)]
    assert config.layer_types == tuple(
        "sliding_attention" if w else "full_attention" for w in windowed
    )
    assert config.option("rope_layers") == tuple(windowed)
    # An int pattern reads the same; no window: every layer global, and rotating.
    same = model_config_from_hf({**EXAONE4_32B, "sliding_window_pattern": 4}, "bfloat16")
    assert same.layer_types == config.layer_types
    unwindowed = model_config_from_hf({**EXAONE4_32B, "sliding_window": None}, "bfloat16")
    assert set(unwindowed.layer_types) == {"full_attention"}
    assert unwindowed.option("rope_layers") is None


@pytest.mark.parametrize("pattern", ["LLXG", 0, True, ""])
def test_exaone4_config_refuses_a_pattern_it_cannot_read(pattern):
    with pytest.raises(ValueError, match="sliding_window_pattern must be"):
        model_config_from_hf({**EXAONE4_32B, "sliding_window_pattern": pattern}, "bfloat16")
