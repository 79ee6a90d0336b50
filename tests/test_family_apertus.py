"""Apertus (ApertusForCausalLM) through the engine against HF transformers: the xIELU MLP with
its learned values a layer, per-head q/k norms, Llama 3's rope scaling by default; its config as
the hub's checkpoint ships it."""

import torch
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


def _save_apertus(path, config):
    """save_random_model, with each layer's xIELU beta and eps (buffers, so left at their
    init) made to differ by layer."""
    model = save_random_model(path, config)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.mlp.act_fn.beta.fill_(0.3 + 0.2 * i)
            layer.mlp.act_fn.eps.fill_(-0.5 * (i + 1))
    model.save_pretrained(path)
    return model


def test_apertus_with_xielu_decodes_like_hf(tmp_path):
    hf_model = _save_apertus(tmp_path, transformers.ApertusConfig(**TINY))
    assert_matches_hf(tmp_path, hf_model, PROMPTS)


def test_apertus_with_a_shared_activation_matches_hf_logits(tmp_path):
    config = transformers.ApertusConfig(**TINY, hidden_act="relu2")
    ours, _ = assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])
    assert ours.hidden_act == "relu2" and not ours.option("xielu")


# Apertus-8B-Instruct-2509's config.json, fields trimmed.
APERTUS_8B = {
    "architectures": ["ApertusForCausalLM"],
    "model_type": "apertus",
    "hidden_act": "xielu",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 65536,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 12000000,
    "vocab_size": 131072,
}


def test_the_released_config_reads_its_rope_and_activation():
    config = model_config_from_hf(APERTUS_8B, "bfloat16")
    assert config.option("xielu") and config.qk_norm and config.rope_theta == 12e6
    assert config.rope_scaling is not None
    untold = {k: v for k, v in APERTUS_8B.items() if k not in ("rope_scaling", "rope_theta")}
    assert model_config_from_hf(untold, "bfloat16").rope_scaling == config.rope_scaling
