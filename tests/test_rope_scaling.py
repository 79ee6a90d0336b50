"""Rope scalings (YaRN, dynamic NTK) and partial rotary embeddings against HF transformers.

The original contexts here are small (16-64 positions), so the prompts (up to 120 tokens) pass
them and the scaled frequencies decide the tokens.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits
from family_parity import assert_matches_hf, ragged_prompts, save_random_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from jvllm import LLM
from jvllm.layers.rotary import apply_rope, inverse_frequencies, rope_cos_sin
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.rope_config import SUPPORTED_ROPE_TYPES

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,  # H = 32: 16 frequencies, so YaRN's ramp has a middle
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# 32 * 8 = max_position_embeddings, the context YaRN extends to (else HF warns of a mismatch).
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
# HF's parameters one at a time: the ramp's ends, no truncation, DeepSeek's mscale ratio, a
# given attention factor, a null factor (max_position_embeddings / original).
YARN_VARIANTS = {
    "defaults": YARN,
    "betas_untruncated": {
        **YARN,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    "attention_factor": {**YARN, "attention_factor": 1.3},
    "null_factor": {**YARN, "factor": None, "original_max_position_embeddings": 16},
}
FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,  # q/k/v biases
    "qwen3": transformers.Qwen3Config,  # q/k norms before the rotation
}


def _hf_config(family: str, rope: dict | None, **overrides):
    kwargs = {**TINY, **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", 32)
    if rope is not None:
        kwargs["rope_scaling"] = dict(rope)
    return FAMILIES[family](**kwargs)


def _long_prompt(length: int = 120) -> list[int]:
    return np.random.default_rng(1).integers(3, TINY["vocab_size"], length).tolist()


def _hf_logits(model, token_ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def _config_json(**overrides) -> dict:
    return {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", **overrides}


@pytest.mark.parametrize("theta", [1e4, 1e6])
@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_frequencies_and_attention_factor_are_hfs(variant, theta):
    rope = YARN_VARIANTS[variant]
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](
        transformers.LlamaConfig(**TINY, rope_theta=theta, rope_scaling=dict(rope))
    )
    config = model_config_from_hf(
        _config_json(rope_theta=theta, rope_scaling=dict(rope)), "float32"
    )
    assert config.rope_scaling.attention_factor == pytest.approx(hf_attention_factor, rel=1e-12)
    np.testing.assert_allclose(inverse_frequencies(config), hf_inv_freq.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    ("family", "variant"),
    [("llama", v) for v in YARN_VARIANTS] + [("qwen2", "defaults"), ("qwen3", "defaults")],
)
def test_yarn_logits_match_hf(tmp_path, family, variant):
    hf_model = save_random_model(tmp_path, _hf_config(family, YARN_VARIANTS[variant]))
    prompt = _long_prompt()
    expected = _hf_logits(hf_model, prompt)
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert config.rope_scaling.rope_type == "yarn"
    np.testing.assert_allclose(dense_logits(config, params, prompt), expected, rtol=1e-4, atol=1e-4)
    # The scaling moves them: the same weights unscaled give other logits.
    unscaled_model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, None))
    unscaled_model.eval().load_state_dict(hf_model.state_dict())
    assert np.abs(_hf_logits(unscaled_model, prompt) - expected).max() > 0.1


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_yarn_decodes_like_hf(tmp_path, family):
    hf_model = save_random_model(tmp_path, _hf_config(family, YARN))
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


def test_yarn_config_is_read_from_either_layout_and_extends_the_context():
    # Qwen2.5's recipe (transformers 4 layout, "type"): 32768 positions, 4 times as many.
    qwen25 = _config_json(
        max_position_embeddings=32768,
        rope_theta=1e6,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    config = model_config_from_hf(qwen25, "float32")
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1e6, "yarn")
    assert config.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert config.max_position_embeddings == 131072  # vLLM's default max_model_len for it
    # Qwen3's (transformers 5 layout): max_position_embeddings 40960 is within 32768 * 4.
    qwen3 = _config_json(
        max_position_embeddings=40960,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    config = model_config_from_hf(qwen3, "float32")
    assert (config.rope_theta, config.max_position_embeddings) == (1e6, 131072)
    # No original context in the rope dict: HF takes max_position_embeddings (a top-level
    # original_max_position_embeddings is not read for Llama, as HF does not read it).
    config = model_config_from_hf(
        _config_json(
            original_max_position_embeddings=8, rope_scaling={"type": "yarn", "factor": 2}
        ),
        "float32",
    )
    assert config.rope_scaling.original_max_position_embeddings == TINY["max_position_embeddings"]
    assert config.max_position_embeddings == 2 * TINY["max_position_embeddings"]
    # vLLM's recipe, hf_overrides={"rope_scaling": ...}, over a transformers 5 config: the
    # scaling replaces rope_parameters' (as HF reads it), over the checkpoint's base.
    overridden = {
        **qwen3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    config = model_config_from_hf(overridden, "float32")
    assert (config.rope_theta, config.rope_scaling.rope_type) == (1e6, "yarn")


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "'ntk-by-parts' is not supported"),
        ({"rope_type": "yarn"}, "rope_scaling.factor is required"),
        ({**YARN, "beta_fast": -1}, "beta_fast and beta_slow must be > 0"),
    ],
)
def test_an_unknown_or_bad_rope_scaling_is_a_clear_error(rope, message):
    with pytest.raises(ValueError, match=message) as error:
        model_config_from_hf(_config_json(rope_scaling=rope), "float32")
    if "not supported" in message:  # the message lists what is
        assert str(SUPPORTED_ROPE_TYPES) in str(error.value)


def test_dynamic_ntk_matches_hf_within_max_position_embeddings(tmp_path):
    """HF's dynamic NTK scales only past max_position_embeddings (64 here), which max_model_len
    never passes: within it, every position rotates as HF rotates it."""
    max_len = 64
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    hf_model = save_random_model(
        tmp_path, _hf_config("llama", dynamic, max_position_embeddings=max_len)
    )
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert config.rope_scaling.rope_type == "dynamic"
    assert config.max_position_embeddings == max_len
    prompt = _long_prompt(max_len)
    expected = _hf_logits(hf_model, prompt)
    np.testing.assert_allclose(dense_logits(config, params, prompt), expected, rtol=1e-4, atol=1e-4)
    # Past it, HF re-rotates every position, the cached ones included: a longer context is
    # refused (use YaRN for one).
    longer = prompt + _long_prompt(16)
    assert np.abs(_hf_logits(hf_model, longer)[:max_len] - expected).max() > 1e-2
    too_long = "larger than the model's max_position_embeddings.*hf_overrides"
    with pytest.raises(ValueError, match=too_long):
        LLM(str(tmp_path), dtype="float32", max_model_len=max_len + 1)


# Partial rotary embeddings.

PHI3_TINY = {**TINY, "hidden_size": 64}  # H = 16; 0.75 of it: R = 12, 6 frequencies
PARTIAL = 0.75
NUM_PAIRS = 6
SHORT_FACTOR = [1.0 + 0.1 * i for i in range(NUM_PAIRS)]
LONG_FACTOR = [1.5 + 1.5 * i for i in range(NUM_PAIRS)]


def test_apply_rope_rotates_the_first_rotary_dims_as_hf_and_passes_the_rest():
    config = model_config_from_hf(
        {**PHI3_TINY, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": PARTIAL},
        "float32",
    )
    assert (config.head_dim, config.rotary_dim) == (16, 12)
    positions = jnp.arange(40, dtype=jnp.int32)
    cos, sin = rope_cos_sin(positions, config)
    assert cos.shape == sin.shape == (40, 12)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((40, 4, 16)).astype(np.float32)  # [T, N, H]
    k = rng.standard_normal((40, 2, 16)).astype(np.float32)  # [T, K, H]
    ours_q, ours_k = apply_rope(jnp.asarray(q), cos, sin), apply_rope(jnp.asarray(k), cos, sin)
    # HF's layout: [B, heads, T, H] and cos/sin [B, T, R].
    hf_cos, hf_sin = torch.tensor(np.asarray(cos))[None], torch.tensor(np.asarray(sin))[None]
    hf_q, hf_k = apply_rotary_pos_emb(
        torch.tensor(q).transpose(0, 1)[None], torch.tensor(k).transpose(0, 1)[None], hf_cos, hf_sin
    )
    np.testing.assert_allclose(ours_q, hf_q[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours_k, hf_k[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours_q)[..., 12:], q[..., 12:])


def _phi3_config(rope=None, **overrides) -> transformers.Phi3Config:
    kwargs = {**PHI3_TINY, "partial_rotary_factor": PARTIAL, **overrides}
    return transformers.Phi3Config(**kwargs, rope_scaling=rope)


def test_phi3_partial_rotary_decodes_like_hf(tmp_path):
    hf_model = save_random_model(tmp_path, _phi3_config())
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert config.rotary_dim == 12
    prompt = _long_prompt()
    np.testing.assert_allclose(
        dense_logits(config, params, prompt), _hf_logits(hf_model, prompt), rtol=1e-4, atol=1e-4
    )
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


def test_phi3_partial_rotary_with_longrope_decodes_like_hf(tmp_path):
    """LongRoPE over the rotated dims only (one factor per rotated pair), past its original
    context: the long factors at every position, as test_family_phi3 explains."""
    rope = {"rope_type": "longrope", "short_factor": SHORT_FACTOR, "long_factor": LONG_FACTOR}
    hf_model = save_random_model(tmp_path, _phi3_config(rope, original_max_position_embeddings=32))
    long_rope = {**rope, "short_factor": LONG_FACTOR}
    long_model = transformers.Phi3ForCausalLM(
        _phi3_config(long_rope, original_max_position_embeddings=32)
    ).eval()
    long_model.load_state_dict(hf_model.state_dict())
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert config.rotary_dim == 12 and config.rope_scaling.use_long_factor
    prompt = _long_prompt()
    expected = _hf_logits(hf_model, prompt)
    np.testing.assert_array_equal(_hf_logits(long_model, prompt), expected)
    np.testing.assert_allclose(dense_logits(config, params, prompt), expected, rtol=1e-4, atol=1e-4)
    assert_matches_hf(tmp_path, long_model, ragged_prompts(TINY["vocab_size"]))


def _phi4_mini_json(**overrides) -> dict:
    """Phi-4-mini's layout: H = 128, 0.75 of it rotated, LongRoPE factors for those 96 dims."""
    rope = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    return {
        **TINY,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 3072,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rope_scaling": rope,
        **overrides,
    }


def test_phi4_mini_config_rotates_three_quarters_of_each_head():
    config = model_config_from_hf(_phi4_mini_json(), "float32")
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (128, 96, 0.75)
    assert config.rope_scaling.rope_type == "longrope"
    assert inverse_frequencies(config).shape == (48,)
    # transformers 5 keeps the factor in the rope dict, which wins over the top level's.
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    layout5 = _phi4_mini_json(rope_parameters=rope, rope_scaling=None)
    config = model_config_from_hf(layout5, "float32")
    assert config.rotary_dim == 64
    with pytest.raises(ValueError, match=r"one factor per pair of rotated head dims \(48\)"):
        rope = {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}
        model_config_from_hf(_phi4_mini_json(rope_scaling=rope), "float32")
    with pytest.raises(ValueError, match="must rotate an even number"):
        model_config_from_hf(
            _phi4_mini_json(partial_rotary_factor=0.7, rope_scaling=None), "float32"
        )


def test_a_llama_config_rotates_whole_heads_whatever_its_partial_rotary_factor(tmp_path):
    """HF's Llama ignores partial_rotary_factor (its rotary embedding covers whole heads), and so
    does the Llama family here."""
    hf_model = save_random_model(tmp_path, _hf_config("llama", None, partial_rotary_factor=0.5))
    config, params = load_hf_dir(str(tmp_path), "float32")
    assert (config.partial_rotary_factor, config.rotary_dim) == (1.0, config.head_dim)
    prompt = _long_prompt(40)
    np.testing.assert_allclose(
        dense_logits(config, params, prompt), _hf_logits(hf_model, prompt), rtol=1e-4, atol=1e-4
    )


_ROPE_THETA_CLASSES = (
    "LlamaConfig",
    "Qwen2Config",
    "Qwen3Config",
    "Phi3Config",
    "GemmaConfig",
    "Gemma2Config",
    "GraniteConfig",
    "SmolLM3Config",
    "Olmo2Config",
    "StableLmConfig",
    "Starcoder2Config",
    "PhiConfig",
    "Qwen2MoeConfig",
)


@pytest.mark.parametrize("config_class", _ROPE_THETA_CLASSES)
def test_each_familys_saved_rope_base_is_read_over_its_defaults(config_class):
    """A transformers 5 config.json keeps rope_theta in rope_parameters, where a family's
    defaults (written at the top level) must not win over it."""
    tiny = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    hf = getattr(transformers, config_class)(**tiny, num_key_value_heads=2, rope_theta=123456.0)
    config = model_config_from_hf(hf.to_dict(), "float32")
    assert config.rope_theta == 123456.0
