"""Phi-3 (fused q|k|v and gate|up checkpoints, LongRoPE) through the engine against HF transformers."""

import numpy as np
import pytest
import transformers
from family_parity import assert_matches_hf, ragged_prompts, save_random_model

from jvllm.config import ModelConfig

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
NUM_PAIRS = 8  # head_dim 16 / 2
SHORT_FACTOR = [1.0 + 0.1 * i for i in range(NUM_PAIRS)]
LONG_FACTOR = [1.5 + 1.5 * i for i in range(NUM_PAIRS)]


def test_phi3_decodes_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.Phi3Config(**TINY))
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


def _phi3_json(**overrides) -> dict:
    """A config.json in Phi-3-mini-128k's layout (transformers 4: rope_scaling, old names)."""
    rope = {"type": "su", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
    return {
        **TINY,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {**rope, "original_max_position_embeddings": 999},
        "sliding_window": 262144,
        **overrides,
    }


def test_phi3_config_reads_as_hf_reads_it():
    config = ModelConfig.from_hf_config(_phi3_json(), "float32")
    scaling = config.rope_scaling
    assert scaling.rope_type == "longrope"  # "su" is its old name
    assert scaling.original_max_position_embeddings == 4096  # the top-level field wins
    assert scaling.attention_factor == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))
    # A window longer than any sequence never cuts: dropped. Phi-3-mini-4k's 2047 cuts.
    assert config.sliding_window is None
    mini_4k = ModelConfig.from_hf_config(
        _phi3_json(max_position_embeddings=4096, rope_scaling=None, sliding_window=2047),
        "float32",
    )
    assert mini_4k.layer_windows == (2047, 2047)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            "short_factor must give one factor per pair",
        ),
    ],
)
def test_phi3_config_rejects_what_it_cannot_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_phi3_json(**overrides), "float32")
