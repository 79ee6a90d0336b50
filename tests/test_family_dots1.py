"""dots.llm1 (Dots1ForCausalLM) through the engine against HF transformers: Qwen3's attention
(per-head q/k norms, windows from max_window_layers) over GLM-4.5's DeepSeek-V3-routed experts;
its config as the hub's checkpoint ships it."""

import transformers
from family_parity import (
    TINY_SHAPES,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_with_correction_biases,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {
    **TINY_SHAPES,
    "num_hidden_layers": 3,
    "head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 48,
    "first_k_dense_replace": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS = ragged_prompts(TINY["vocab_size"], lengths=(5, 17, 40))


def test_dots1_with_a_windowed_last_layer_decodes_like_hf(tmp_path):
    config = transformers.Dots1Config(
        **TINY, sliding_window=8, max_window_layers=2, norm_topk_prob=True, attention_bias=True
    )
    hf_model = save_with_correction_biases(tmp_path, config)
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_dots1_unwindowed_and_unrenormalised_matches_hf_logits(tmp_path):
    config = transformers.Dots1Config(**TINY, sliding_window=None, routed_scaling_factor=2.0)
    ours, _ = assert_logits_match_hf(
        tmp_path, save_with_correction_biases(tmp_path, config), PROMPTS[-1]
    )
    assert ours.qk_norm and not ours.norm_topk_prob and ours.sliding_window is None


# dots.llm1.inst's config.json, fields trimmed.
DOTS_LLM1 = {
    "architectures": ["Dots1ForCausalLM"],
    "model_type": "dots1",
    "first_k_dense_replace": 1,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "max_window_layers": 62,
    "moe_intermediate_size": 1408,
    "n_routed_experts": 128,
    "n_shared_experts": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 62,
    "num_key_value_heads": 32,
    "rope_theta": 10000000,
    "routed_scaling_factor": 2.5,
    "sliding_window": 4096,
    "vocab_size": 152064,
}


def test_the_released_config_reads_no_window_and_its_router():
    config = model_config_from_hf(DOTS_LLM1, "bfloat16")
    assert config.sliding_window is None and config.option("num_dense_layers") == 1
    assert config.num_experts == 128 and config.shared_expert_intermediate_size == 2 * 1408
    assert config.option("routed_scaling_factor") == 2.5 and config.norm_topk_prob
