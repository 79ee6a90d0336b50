"""Granite, SmolLM3, OLMo 2 and OLMo 3 through the engine against HF transformers, each with the
settings that set it apart from Llama at values where a wrong reading shows, and their configs
as the hub's checkpoints ship them."""

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

TINY = {
    **TINY_SHAPES,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "attn_implementation": "eager",  # HF applies windows in it
}
WINDOW = 8  # with pages of 4, the long prompts and the prefix hit leave whole pages behind
PROMPTS = ragged_prompts(TINY["vocab_size"])
CONFIGS = {
    # Every scaling far from 1; the scores' (1.0) 4x H^-1/2.
    "granite": lambda: transformers.GraniteConfig(
        **TINY,
        embedding_multiplier=6.0,
        residual_multiplier=0.3,
        attention_multiplier=1.0,
        logits_scaling=4.0,
    ),
    # Layer 1 without rope, and windowed, as SmolLM3 windows its no-rope layers.
    "smollm3": lambda: transformers.SmolLM3Config(
        **TINY, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW
    ),
    "olmo2": lambda: transformers.Olmo2Config(**TINY),
    # A windowed layer, then a global one whose rope alone has the linear scaling.
    "olmo3": lambda: transformers.Olmo3Config(
        **TINY,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    if getattr(hf_model.config, "sliding_window", None) is not None:
        assert_hf_window_cuts(hf_model, PROMPTS[-1])
    assert_matches_hf(tmp_path, hf_model, PROMPTS, block_size=4)
    if name == "granite":  # logits_scaling keeps the argmax: the logits check it
        assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


LOGITS_CONFIGS = {
    # Biases on q/k/v (before the whole-projection norms) and o, and another activation.
    "olmo2_biased_gelu": lambda: transformers.Olmo2Config(
        **TINY, attention_bias=True, hidden_act="gelu_pytorch_tanh"
    ),
    "olmo3_biased": lambda: transformers.Olmo3Config(
        **TINY, attention_bias=True, sliding_window=WINDOW
    ),
}


@pytest.mark.parametrize("name", list(LOGITS_CONFIGS))
def test_config_variant_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, LOGITS_CONFIGS[name]())
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


# Config files in the layouts the hub's checkpoints ship (transformers 4), fields trimmed.
GRANITE_3_2B = {
    "architectures": ["GraniteForCausalLM"],
    "model_type": "granite",
    "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "logits_scaling": 8.0,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "residual_multiplier": 0.22,
    "rope_theta": 5000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49155,
}
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "model_type": "smollm3",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "no_rope_layer_interval": 4,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 128256,
}
OLMO_3_7B = {
    "architectures": ["Olmo3ForCausalLM"],
    "model_type": "olmo3",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "yarn",
    },
    "rope_theta": 500000,
    "sliding_window": 4096,
    "vocab_size": 100278,
}


def test_granite_config_reads_its_four_scalings():
    config = model_config_from_hf(GRANITE_3_2B, "bfloat16")
    assert config.sm_scale == 0.015625  # in place of 64^-1/2
    assert config.option("embedding_multiplier") == 12.0
    assert config.option("residual_multiplier") == 0.22
    assert config.option("logits_scaling") == 8.0
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    # GraniteConfig's default attention_multiplier is 1.0, not H^-1/2.
    bare = {k: v for k, v in GRANITE_3_2B.items() if k != "attention_multiplier"}
    assert model_config_from_hf(bare, "float32").sm_scale == 1.0


def test_smollm3_config_reads_its_no_rope_layers_and_defaults():
    config = model_config_from_hf(SMOLLM3_3B, "bfloat16")
    rope_layers = config.option("rope_layers")
    assert rope_layers[:4] == (True, True, True, False) and sum(rope_layers) == 27
    assert config.layer_windows == (None,) * 36 and config.tie_word_embeddings
    assert config.rope_theta == 5e6 and config.eos_token_ids == (128001,)
    # Without no_rope_layers, the interval gives them; use_sliding_window windows those layers.
    derived = {k: v for k, v in SMOLLM3_3B.items() if k not in ("no_rope_layers", "rope_theta")}
    derived.update(no_rope_layer_interval=3, use_sliding_window=True, sliding_window=512)
    config = model_config_from_hf(derived, "float32")
    assert config.option("rope_layers")[:6] == (True, True, False) * 2
    assert config.layer_windows[:6] == (None, None, 512) * 2
    assert config.rope_theta == 2e6  # SmolLM3Config's default


def test_olmo3_config_windows_three_layers_of_four_and_scales_only_global_rope():
    config = model_config_from_hf(OLMO_3_7B, "bfloat16")
    assert config.layer_windows[:4] == (4096, 4096, 4096, None)
    assert config.rope_scaling.rope_type == "yarn" and config.rope_theta == 500000
    assert config.local_rope_theta == 500000  # the windowed layers' rope, unscaled
    assert config.rms_norm_eps == 1e-6 and not config.tie_word_embeddings
    olmo2 = {**OLMO_3_7B, "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
    del olmo2["rms_norm_eps"]
    config = model_config_from_hf(olmo2, "float32")
    assert config.layer_windows == (None,) * 32 and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    ("hf_config", "message"),
    [
        ({**GRANITE_3_2B, "logits_scaling": 0}, "logits_scaling must be a number > 0"),
        ({**SMOLLM3_3B, "no_rope_layers": [1, 0]}, "no_rope_layers must give 1"),
        (
            {**SMOLLM3_3B, "layer_types": ["sliding_attention"] * 36},
            "use_sliding_window is false",
        ),
    ],
)
def test_configs_refuse_what_they_cannot_run(hf_config, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf_config, "float32")
