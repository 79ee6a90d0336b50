"""Cohere, Cohere2, GLM, GLM-4 and GPT-J (interleaved rotary embeddings) through the engine
against HF transformers, the interleaved rotation against HF's own functions, and how their
config.json files are read."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_hf_window_cuts,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)
from transformers.models.glm import modeling_glm
from transformers.models.gptj import modeling_gptj

from jvllm.config import ModelConfig
from jvllm.layers.rotary import apply_rope, rope_cos_sin
from jvllm.model_loader.hf_config import model_config_from_hf

VOCAB_SIZE = TINY_SHAPES["vocab_size"]
# Past a page, past the Cohere2 window below and past a 32-token prefill chunk.
PROMPTS = ragged_prompts(VOCAB_SIZE, lengths=(1, 17, 40))
HEAD_DIM = TINY_SHAPES["hidden_size"] // TINY_SHAPES["num_attention_heads"]  # 16
CONFIGS = {
    # Per-head q/k LayerNorms, q/k/v/o biases, logits scaled by 0.5, the tied LM head.
    "cohere": lambda: transformers.CohereConfig(
        **TINY_SHAPES, use_qk_norm=True, attention_bias=True, logit_scale=0.5
    ),
    # A sliding layer (rotary, a window of 8) then a global one (no rotary at all), untied.
    "cohere2": lambda: transformers.Cohere2Config(
        **TINY_SHAPES,
        sliding_window=8,
        sliding_window_pattern=2,
        logit_scale=2.0,
        tie_word_embeddings=False,
    ),
    # 8 of 16 dims rotating (GlmConfig's 0.5), interleaved; q/k/v biases, fused gate_up_proj.
    "glm": lambda: transformers.GlmConfig(**TINY_SHAPES, head_dim=HEAD_DIM, pad_token_id=0),
    # GLM's, 12 of 16 dims rotating, the blocks' outputs normed again.
    "glm4": lambda: transformers.Glm4Config(
        **TINY_SHAPES, head_dim=HEAD_DIM, partial_rotary_factor=0.75, pad_token_id=0
    ),
    # 6 of 16 dims rotating interleaved, one LayerNorm for both branches, biased MLP and head.
    "gptj": lambda: transformers.GPTJConfig(
        vocab_size=VOCAB_SIZE, n_positions=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=6
    ),
}


# GLM differs from GLM-4 only in its blocks (Llama's): its logits suffice, which keeps the
# file's engine runs to four.
@pytest.mark.parametrize("name", ["cohere", "cohere2", "glm4", "gptj"])
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    if getattr(hf_model.config, "sliding_window", None) is not None:
        assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8, block_size=4)


# Cohere's logit_scale (0.5) leaves greedy tokens alone: the logits themselves show it.
@pytest.mark.parametrize("name", ["cohere", "glm"])
def test_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    token_ids = np.random.default_rng(0).integers(0, VOCAB_SIZE, 12)
    assert_logits_match_hf(tmp_path, hf_model, token_ids)


def _read(hf_json: dict) -> ModelConfig:
    return model_config_from_hf(hf_json, "float32")


def _ours(config: ModelConfig, x: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """apply_rope of x [T, heads, H] at positions i32[T], as the engine runs it."""
    cos, sin = rope_cos_sin(positions, config)
    return np.asarray(apply_rope(x.numpy(), cos, sin, config.is_rope_interleaved))


def test_interleaved_rope_matches_hf_gptj_rotate_every_two():
    gptj = {"architectures": ["GPTJForCausalLM"], "n_embd": 64, "n_head": 4, "rotary_dim": 6}
    config = _read(gptj)
    positions = np.arange(0, 90, 7, dtype=np.int32)  # [T]
    x = torch.randn(len(positions), 4, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    table = modeling_gptj.create_sinusoidal_positions(128, 6)[positions]  # [T, 6]: sin | cos
    sin, cos = torch.split(table[None], 3, dim=-1)  # [1, T, 3] each
    rotated = modeling_gptj.apply_rotary_pos_emb(x[None, ..., :6], sin, cos)[0]  # [T, 4, 6]
    expected = torch.cat([rotated, x[..., 6:]], dim=-1).numpy()
    np.testing.assert_allclose(_ours(config, x, positions), expected, atol=2e-5)
    # The rotate-half layout (pairs i, i + 3) rotates otherwise: the flag is what matches.
    rotate_half = dataclasses.replace(config, is_rope_interleaved=False)
    assert not np.allclose(_ours(rotate_half, x, positions), expected, atol=1e-3)


def test_interleaved_partial_rope_matches_hf_glm():
    hf_config = transformers.GlmConfig(**TINY_SHAPES, head_dim=HEAD_DIM)
    config = _read(hf_config.to_dict())
    positions = np.arange(0, 90, 7, dtype=np.int32)  # [T]
    x = torch.randn(len(positions), 4, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    cos, sin = modeling_glm.GlmRotaryEmbedding(hf_config)(x, torch.tensor(positions)[None])
    q = x.transpose(0, 1)[None]  # [1, heads, T, H]
    expected, _ = modeling_glm.apply_rotary_pos_emb(q, q, cos, sin)
    expected = expected[0].transpose(0, 1)  # [T, heads, H]
    assert config.rotary_dim == 8
    np.testing.assert_allclose(_ours(config, x, positions), expected.numpy(), atol=2e-5)


def test_config_json_defaults_are_the_config_classes():
    cohere2 = _read({**TINY_SHAPES, "num_hidden_layers": 8, "model_type": "cohere2"})
    assert cohere2.architecture == "Cohere2ForCausalLM"
    # Cohere2Config's sliding_window_pattern 4: every 4th layer global, and only it unrotated.
    assert cohere2.layer_types == (("sliding_attention",) * 3 + ("full_attention",)) * 2
    assert cohere2.option("rope_layers") == (True, True, True, False) * 2
    assert (cohere2.sliding_window, cohere2.rope_theta, cohere2.tie_word_embeddings) == (
        4096,
        10000.0,
        True,
    )
    cohere = _read({**TINY_SHAPES, "model_type": "cohere"})
    assert (cohere.rope_theta, cohere.option("logit_scale"), cohere.sliding_window) == (
        500000.0,
        0.0625,
        None,
    )
    glm = _read({**TINY_SHAPES, "model_type": "glm4"})
    assert (glm.architecture, glm.head_dim, glm.rotary_dim) == ("Glm4ForCausalLM", 128, 64)
    assert glm.attention_bias and glm.is_rope_interleaved
    gptj = _read({"model_type": "gptj", "n_embd": 256, "n_head": 4, "n_layer": 2})
    assert (gptj.intermediate_size, gptj.rotary_dim, gptj.num_kv_heads) == (1024, 64, 4)


@pytest.mark.parametrize(
    ("hf_json", "message"),
    [
        ({"model_type": "cohere", "logit_scale": None}, "logit_scale must be a nonzero number"),
        ({"model_type": "cohere2", "sliding_window": None}, "sliding_window=None"),
        ({"model_type": "cohere", "hidden_act": "laplace"}, "hidden_act='laplace'"),
        (
            {"model_type": "glm", "partial_rotary_factor": 0.2, "head_dim": 16},
            "must rotate an even",
        ),
        ({"model_type": "gptj", "rotary_dim": None}, "rotary_dim=None is not supported"),
        ({"model_type": "gptj", "rotary_dim": 7}, "rotary_dim=7 is not supported"),
        ({"model_type": "gptj", "rotary_dim": 32}, "head_dim=16"),
    ],
)
def test_unsupported_settings_are_named(hf_json, message):
    gptj_shapes = {"n_embd": 64, "n_head": 4, "n_layer": 2}
    shapes = gptj_shapes if hf_json["model_type"] == "gptj" else TINY_SHAPES
    with pytest.raises(ValueError, match=message):
        _read({**shapes, **hf_json})
