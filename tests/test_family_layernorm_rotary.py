"""GPT-NeoX, Phi, Starcoder2 and StableLM (LayerNorm layers, partial rotary embeddings, parallel or
sequential residuals) through the engine against HF transformers, their config variants' logits,
and how their config.json files and checkpoints are read."""

import dataclasses

import numpy as np
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
from safetensors.numpy import load_file, save_file

from jvllm.config import ModelConfig
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import param_axes

VOCAB_SIZE = TINY_SHAPES["vocab_size"]
# Fewer and shorter than the default (HF's greedy decoding is most of a parity check's time),
# still past a page, past the window below and past a 32-token prefill chunk.
PROMPTS = ragged_prompts(VOCAB_SIZE, lengths=(1, 17, 40))
# head_dim 16: each rotary fraction below turns fewer than all of a head's dims.
ENGINE_CONFIGS = {
    # Parallel residual with two norms, 4 of 16 dims rotating, fused per-head q|k|v with biases,
    # an untied embed_out.
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**TINY_SHAPES, rotary_pct=0.25),
    # One norm feeding both branches, 6 of 16 dims rotating (Phi-2's 0.4), shared q/k
    # LayerNorms, an LM head with a bias, grouped KV heads.
    "phi": lambda: transformers.PhiConfig(
        **TINY_SHAPES, partial_rotary_factor=0.4, qk_layernorm=True
    ),
    # A window that cuts the longer prompts, biases everywhere, a tied LM head.
    "starcoder2": lambda: transformers.Starcoder2Config(
        **TINY_SHAPES, sliding_window=8, bos_token_id=0, eos_token_id=0
    ),
    # Sequential, 4 of 16 dims rotating, q/k/v biases, per-head q/k LayerNorms (own weights).
    "stablelm": lambda: transformers.StableLmConfig(
        **TINY_SHAPES, use_qkv_bias=True, qk_layernorm=True
    ),
}


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, ENGINE_CONFIGS[name]())
    if getattr(hf_model.config, "sliding_window", None) is not None:
        assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8, block_size=4)


LOGITS_CONFIGS = {
    "gpt_neox_sequential_unbiased_tied": lambda: transformers.GPTNeoXConfig(
        **TINY_SHAPES,
        use_parallel_residual=False,
        attention_bias=False,
        tie_word_embeddings=True,
        hidden_act="gelu_fast",
        rotary_pct=0.5,
        rotary_emb_base=500.0,
        rope_scaling={"rope_type": "linear", "factor": 3.0},  # over the rotated dims only
    ),
    # The LM head's weight is the embedding, its bias its own.
    "phi_tied_without_qk_norm": lambda: transformers.PhiConfig(
        **TINY_SHAPES, tie_word_embeddings=True
    ),
    "starcoder2_unbiased_untied": lambda: transformers.Starcoder2Config(
        **TINY_SHAPES, use_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0
    ),
    "stablelm_parallel_one_norm": lambda: transformers.StableLmConfig(
        **TINY_SHAPES, use_parallel_residual=True, partial_rotary_factor=0.5
    ),
}


@pytest.mark.parametrize("name", list(LOGITS_CONFIGS))
def test_config_variant_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, LOGITS_CONFIGS[name]())
    token_ids = np.random.default_rng(0).integers(0, VOCAB_SIZE, 12)
    assert_logits_match_hf(tmp_path, hf_model, token_ids, rtol=1e-4)


def _read(hf_json: dict) -> ModelConfig:
    return model_config_from_hf(hf_json, "float32")


def test_pythia_config_json_reads_its_old_rotary_names():
    pythia = {
        **TINY_SHAPES,
        "architectures": ["GPTNeoXForCausalLM"],
        "rotary_pct": 0.5,
        "rotary_emb_base": 500,
        "use_parallel_residual": True,
    }
    config = _read(pythia)
    assert (config.rotary_dim, config.rope_theta, config.num_kv_heads) == (8, 500.0, 4)
    assert config.attention_bias and not config.tie_word_embeddings  # GPTNeoXConfig's defaults
    # transformers 5's rope_parameters win over the old names, as GPTNeoXConfig reads them.
    rope = {"rope_type": "default", "rope_theta": 20.0, "partial_rotary_factor": 0.25}
    config = _read({**pythia, "rope_parameters": rope})
    assert (config.rotary_dim, config.rope_theta) == (4, 20.0)


@pytest.mark.parametrize(
    ("architecture", "rotary_dim"),
    [
        ("PhiForCausalLM", 8),  # PhiConfig's default 0.5
        ("StableLmForCausalLM", 4),  # StableLmConfig's 0.25
        ("Starcoder2ForCausalLM", 16),  # HF's Starcoder2 rotates whole heads
        ("GPTNeoXForCausalLM", 4),  # GPTNeoXConfig's rotary_pct 0.25
    ],
)
def test_rotary_fraction_defaults_are_the_config_classes(architecture, rotary_dim):
    assert _read({**TINY_SHAPES, "architectures": [architecture]}).rotary_dim == rotary_dim


def test_qk_norms_and_head_bias_name_their_axes():
    """What tensor parallelism cuts (tests/scale_out runs them at T = 2): per-head norm weights
    with their heads, the LM head's bias with the vocabulary; Phi's shared norms replicated."""
    phi = _read({**TINY_SHAPES, "architectures": ["PhiForCausalLM"], "qk_layernorm": True})
    axes = param_axes(phi)
    assert axes["layers"]["attn"]["q_norm"]["bias"] == ("layers", "head_dim")
    assert axes["lm_head"]["bias"] == ("vocab",)
    tied = dataclasses.replace(phi, tie_word_embeddings=True)
    assert param_axes(tied)["lm_head_bias"] == ("vocab",)
    stablelm = _read(
        {**TINY_SHAPES, "architectures": ["StableLmForCausalLM"], "qk_layernorm": True}
    )
    attn = param_axes(stablelm)["layers"]["attn"]
    assert (attn["q_norm"]["weight"], attn["k_norm"]["weight"]) == (
        ("layers", "heads"),
        ("layers", "kv_heads"),
    )


def test_neox_checkpoint_with_lm_head_name_loads_like_embed_out(tmp_path):
    """transformers 5 saves the head as embed_out (Pythia's name) and loads it as lm_head."""
    save_random_model(tmp_path / "saved", transformers.GPTNeoXConfig(**TINY_SHAPES))
    tensors = load_file(tmp_path / "saved/model.safetensors")
    assert "embed_out.weight" in tensors
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed/config.json").write_text((tmp_path / "saved/config.json").read_text())
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, tmp_path / "renamed/model.safetensors")
    _, saved = load_hf_dir(str(tmp_path / "saved"), "float32")
    _, renamed = load_hf_dir(str(tmp_path / "renamed"), "float32")
    np.testing.assert_array_equal(renamed["lm_head"]["weight"], saved["lm_head"]["weight"])


@pytest.mark.parametrize(
    ("architecture", "overrides", "message"),
    [
        ("GPTNeoXForCausalLM", {"hidden_act": "laplace"}, "hidden_act='laplace'"),
        ("GPTNeoXForCausalLM", {"rotary_pct": 0.1}, "must rotate an even number"),
        ("PhiForCausalLM", {"partial_rotary_factor": 0.7}, "must rotate an even number"),
        ("StableLmForCausalLM", {"hidden_size": 66}, "multiple of num_attention_heads"),
        ("Starcoder2ForCausalLM", {"rope_scaling": {"rope_type": "ntk"}}, "rope_type='ntk'"),
    ],
)
def test_unsupported_settings_are_named(architecture, overrides, message):
    with pytest.raises(ValueError, match=message):
        _read({**TINY_SHAPES, "architectures": [architecture], **overrides})
