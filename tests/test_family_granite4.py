"""Granite 4.0's attention-only models (GraniteMoeHybridForCausalLM) through the engine against HF
transformers: Granite's scalings, the shared MLP alone or beside experts, rotary embeddings or
none; the hybrid (Mamba 2) configs refused naming their layers."""

import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = {
    **TINY_SHAPES,
    "layer_types": ["attention", "attention"],
    "shared_intermediate_size": 96,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 1.5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
PROMPTS = ragged_prompts(TINY["vocab_size"])


def test_granite_4_micro_like_decodes_like_hf(tmp_path):
    """Granite-4.0-Micro's layout: rotary embeddings, the shared MLP alone."""
    config = transformers.GraniteMoeHybridConfig(
        **TINY, num_local_experts=0, position_embedding_type="rope"
    )
    assert_matches_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS)


def test_experts_beside_the_shared_mlp_without_rotary_match_hf_logits(tmp_path):
    config = transformers.GraniteMoeHybridConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, position_embedding_type=None
    )
    ours, _ = assert_logits_match_hf(tmp_path, save_random_model(tmp_path, config), PROMPTS[-1])
    assert ours.num_experts == 4 and ours.option("rope_layers") == (False, False)


def test_a_config_without_a_shared_mlp_width_takes_hfs_1024():
    fields = {k: v for k, v in TINY.items() if k != "shared_intermediate_size"}
    fields["architectures"] = ["GraniteMoeHybridForCausalLM"]
    with_experts = model_config_from_hf({**fields, "num_local_experts": 4}, "bfloat16")
    assert with_experts.shared_expert_intermediate_size == 1024
    dense = model_config_from_hf({**fields, "num_local_experts": 0}, "bfloat16")
    assert dense.intermediate_size == 1024 and dense.num_experts == 0


def test_mamba_layers_are_refused_naming_them():
    fields = {
        **TINY,
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "layer_types": ["mamba", "attention"],
    }
    with pytest.raises(ValueError, match=r"layers \[0\] .* 'mamba' \(Mamba 2\) layers"):
        model_config_from_hf(fields, "bfloat16")
    untold = {k: v for k, v in fields.items() if k != "layer_types"}
    with pytest.raises(ValueError, match=r"layers \[0, 1\]"):
        model_config_from_hf(untold, "bfloat16")
