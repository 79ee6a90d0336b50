"""ERNIE 4.5 (the dense 0.3B) through the engine against HF transformers: rotary embeddings over
the whole head with GLM's interleaved pairing, and `use_bias` on every projection; its config as
the hub's checkpoint ships it."""

import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits
from family_parity import TINY_SHAPES, assert_matches_hf, ragged_prompts, save_random_model

from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {**TINY_SHAPES, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_ernie4_5_with_biases_decodes_like_hf(tmp_path):
    config = transformers.Ernie4_5Config(**TINY, use_bias=True, tie_word_embeddings=False)
    hf_model = save_random_model(tmp_path, config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS)


def test_ernie4_5_without_biases_logits_match_hf(tmp_path):
    hf_model = save_random_model(tmp_path, transformers.Ernie4_5Config(**TINY))
    config, params = load_hf_dir(str(tmp_path), "float32")
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPTS[-1]])).logits[0].numpy()
    np.testing.assert_allclose(dense_logits(config, params, PROMPTS[-1]), expected, atol=1e-4)


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
