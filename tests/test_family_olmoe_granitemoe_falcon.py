"""OLMoE, GraniteMoE, GraniteMoeShared and Falcon through the engine against HF transformers, the
config variants' logits, and how their config.json files are read or refused."""

import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)

from jvllm.config import ModelConfig
from jvllm.model_loader.hf_config import model_config_from_hf

VOCAB_SIZE = TINY_SHAPES["vocab_size"]
# Fewer and shorter than the default (HF's greedy decoding is most of a parity check's time),
# still past a page and past a 32-token prefill chunk.
PROMPTS = ragged_prompts(VOCAB_SIZE, lengths=(1, 17, 40))
# Falcon's config has no intermediate_size (ffn_hidden_size, default 4D) nor
# num_key_value_heads (num_kv_heads).
FALCON_SHAPES = {
    k: v for k, v in TINY_SHAPES.items() if k not in ("intermediate_size", "num_key_value_heads")
}


def _olmoe(**kwargs) -> transformers.OlmoeConfig:
    return transformers.OlmoeConfig(
        **TINY_SHAPES, num_experts=4, num_experts_per_tok=2, eos_token_id=2, **kwargs
    )


def _granite_moe(config_class, **kwargs):
    # Every scaling far from 1: the embeddings, each block's outputs, the scores (in place of
    # H^-1/2 = 0.25) and the logits.
    scalings = {
        "embedding_multiplier": 6.0,
        "residual_multiplier": 0.3,
        "attention_multiplier": 0.5,
        "logits_scaling": 4.0,
    }
    return config_class(**TINY_SHAPES, num_local_experts=4, **scalings, **kwargs)


ENGINE_CONFIGS = {
    # q/k/v clamped to 0.8 after the whole-projection q/k norms (their values reach ~3), biases
    # on q/k/v and o, top-2 of 4 experts whose weights are not renormalised.
    "olmoe_clipped_biased": lambda: _olmoe(clip_qkv=0.8, attention_bias=True),
    # Granite's scalings, top-2 routing, an ungated shared MLP 32 wide, biases on q/k/v and o.
    "granitemoeshared": lambda: _granite_moe(
        transformers.GraniteMoeSharedConfig, shared_intermediate_size=32, attention_bias=True
    ),
    # Falcon-7B's layout: multi-query (one KV head), one LayerNorm feeding attention and the
    # MLP in parallel, no biases, a tied LM head.
    "falcon_7b_layout": lambda: transformers.FalconConfig(**FALCON_SHAPES),
}


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, ENGINE_CONFIGS[name]())
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8, block_size=4)
    if name == "granitemoeshared":  # logits_scaling keeps the argmax: the logits check it
        assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


LOGITS_CONFIGS = {
    "olmoe_renormalised_tied": lambda: _olmoe(norm_topk_prob=True, tie_word_embeddings=True),
    "granitemoe": lambda: _granite_moe(transformers.GraniteMoeConfig),
    # Falcon-40B's: grouped query_key_value rows (2 KV heads), ln_attn and ln_mlp, biases, an
    # untied LM head.
    "falcon_new_decoder": lambda: transformers.FalconConfig(
        **FALCON_SHAPES,
        new_decoder_architecture=True,
        num_kv_heads=2,
        bias=True,
        tie_word_embeddings=False,
    ),
    # Falcon2-11B's: the new decoder architecture with one LayerNorm for both branches.
    "falcon_new_decoder_one_norm": lambda: transformers.FalconConfig(
        **FALCON_SHAPES, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1
    ),
    # Neither multi_query nor the new architecture: query_key_value head by head ([N, 3, H]);
    # sequential blocks; biases; relu.
    "falcon_per_head_sequential": lambda: transformers.FalconConfig(
        **FALCON_SHAPES, multi_query=False, parallel_attn=False, bias=True, activation="relu"
    ),
}


@pytest.mark.parametrize("name", list(LOGITS_CONFIGS))
def test_config_variant_logits_match_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, LOGITS_CONFIGS[name]())
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


def _read(hf_json: dict) -> ModelConfig:
    return model_config_from_hf(hf_json, "float32")


# tiiuae/falcon-7b's and tiiuae/falcon-40b's config.json, fields trimmed to what is read.
FALCON_7B = {
    "architectures": ["FalconForCausalLM"],
    "model_type": "falcon",
    "alibi": False,
    "bias": False,
    "hidden_size": 4544,
    "layer_norm_epsilon": 1e-05,
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "vocab_size": 65024,
}
FALCON_40B = {
    **FALCON_7B,
    "hidden_size": 8192,
    "new_decoder_architecture": True,
    "num_attention_heads": 128,
    "num_hidden_layers": 60,
    "num_kv_heads": 8,
}


def test_falcon_config_json_reads_as_falcon_config_does():
    falcon_7b = _read(FALCON_7B)
    assert (falcon_7b.num_kv_heads, falcon_7b.head_dim) == (1, 64)
    assert falcon_7b.intermediate_size == 4 * 4544
    assert falcon_7b.tie_word_embeddings and not falcon_7b.attention_bias
    assert falcon_7b.option("residual") == "parallel_shared_norm"
    assert (falcon_7b.eos_token_id, falcon_7b.max_position_embeddings) == (11, 2048)
    falcon_40b = _read(FALCON_40B)
    assert (falcon_40b.num_kv_heads, falcon_40b.option("residual")) == (8, "parallel")


def test_granite_moe_and_olmoe_read_their_config_classes_defaults():
    routing = lambda c: (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
    granite = _read({**TINY_SHAPES, "architectures": ["GraniteMoeForCausalLM"]})
    assert routing(granite) == (8, 2, True)
    assert granite.sm_scale == 1.0  # GraniteMoeConfig's attention_multiplier, not H^-1/2
    olmoe = _read({**TINY_SHAPES, "architectures": ["OlmoeForCausalLM"]})
    assert routing(olmoe) == (64, 8, False)
    assert (olmoe.rms_norm_eps, olmoe.option("clip_qkv")) == (1e-5, None)


@pytest.mark.parametrize(
    ("hf_json", "message"),
    [
        ({**FALCON_7B, "alibi": True}, "alibi=True"),
        ({**FALCON_40B, "parallel_attn": False}, "parallel_attn=False"),
        ({**FALCON_7B, "num_ln_in_parallel_attn": 2}, "num_ln_in_parallel_attn=2"),
        ({**FALCON_7B, "multi_query": False, "num_kv_heads": 8}, "num_kv_heads=8"),
        ({**FALCON_40B, "num_kv_heads": 24}, "multiple of num_kv_heads=24"),
        (
            {**TINY_SHAPES, "architectures": ["OlmoeForCausalLM"], "head_dim": 32},
            "head_dim=32",
        ),
        ({**TINY_SHAPES, "architectures": ["OlmoeForCausalLM"], "clip_qkv": -1}, "clip_qkv"),
        (
            {**TINY_SHAPES, "architectures": ["GraniteMoeForCausalLM"], "hidden_act": "elu"},
            "hidden_act='elu'",
        ),
    ],
)
def test_unsupported_settings_are_named(hf_json, message):
    with pytest.raises(ValueError, match=message):
        _read(hf_json)
