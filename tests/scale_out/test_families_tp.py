"""Every family at T = 2 on the fake CPU devices (conftest.py): a tiny random HF model of each
decodes greedily like HF transformers with its weights, heads and KV cache cut over two
devices (the vocabulary padded: an odd size), each family's parallel layout named beside it."""

import pytest
import transformers
from family_parity import (
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
    save_with_correction_biases,
)
from test_family_gpt_oss import _save_gpt_oss

FAMILY_VOCAB = 511  # odd: the vocabulary shards are padded
_TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": FAMILY_VOCAB,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**_TINY),  # q|k|v biases, cut with their heads
    "gemma2": lambda: transformers.Gemma2Config(
        **_TINY,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        attn_implementation="eager",
    ),
    # q/k norms over all heads: their statistics summed over the devices, the one KV head
    # (and its k norm weights) repeated on both.
    "olmo2": lambda: transformers.Olmo2Config(**{**_TINY, "num_key_value_heads": 1}),
    "gpt2": lambda: transformers.GPT2Config(  # biases after the all-reduces
        n_layer=2, n_embd=64, n_head=4, vocab_size=FAMILY_VOCAB, n_positions=256
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
    ),
    # The shared expert's partial sums join the experts' before their one all-reduce.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_TINY,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
    ),
    # q|k|v reordered from GPT-NeoX's head-by-head rows, then cut shard-major.
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**_TINY),
    # The LM head's bias padded and cut with the vocabulary: its own (untied) and beside the
    # embedding (tied); the shared q/k LayerNorms replicated.
    "phi": lambda: transformers.PhiConfig(**_TINY, qk_layernorm=True),
    "phi_tied": lambda: transformers.PhiConfig(**_TINY, tie_word_embeddings=True),
    # Per-head q/k LayerNorm weights cut with their heads, the one KV head's repeated.
    "stablelm": lambda: transformers.StableLmConfig(
        **{**_TINY, "num_key_value_heads": 1}, qk_layernorm=True, use_qkv_bias=True
    ),
    # Per-head q/k LayerNorm weights cut with their heads; interleaved rope.
    "cohere": lambda: transformers.CohereConfig(**_TINY, use_qk_norm=True, logit_scale=0.5),
    # Interleaved rope on part of each head; norms after each block.
    "glm4": lambda: transformers.Glm4Config(
        **_TINY, head_dim=16, partial_rotary_factor=0.75, pad_token_id=0
    ),
    # A biased LM head of its own, cut with the vocabulary.
    "gptj": lambda: transformers.GPTJConfig(
        n_layer=2, n_embd=64, n_head=4, vocab_size=FAMILY_VOCAB, n_positions=256, rotary_dim=6
    ),
    # clip_qkv on each device's heads; q/k norms over all heads.
    "olmoe": lambda: transformers.OlmoeConfig(
        **_TINY, num_experts=4, num_experts_per_tok=2, clip_qkv=0.8
    ),
    # The ungated shared MLP's partial sums join the experts'.
    "granitemoeshared": lambda: transformers.GraniteMoeSharedConfig(
        **_TINY, num_local_experts=4, shared_intermediate_size=32, residual_multiplier=0.5
    ),
    # One KV head, repeated on both devices, from Falcon-7B's fused multi-query q|k|v.
    "falcon": lambda: transformers.FalconConfig(
        **{k: v for k, v in _TINY.items() if k not in ("intermediate_size", "num_key_value_heads")}
    ),
    # Half-head rotate-half rope; DeepSeek-V3's grouped router, a dense layer first, the shared
    # expert's partial sums joining the experts'.
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **{**_TINY, "num_hidden_layers": 3},
        head_dim=16,
        attention_bias=True,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=48,
    ),
    # Softmax plus a correction bias choosing the experts; two shared experts.
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **{**_TINY, "num_hidden_layers": 3},
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=48,
    ),
    # The ungated ReLU-squared MLP, cut as a dense one.
    "arcee": lambda: transformers.ArceeConfig(**_TINY),
    # xIELU's four values a layer whole on both devices; per-head q/k norms cut with the heads.
    "apertus": lambda: transformers.ApertusConfig(**_TINY),
    # One KV head (multi-query), repeated on both devices; Linear weights.
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(
        n_layer=2, n_embd=64, n_head=4, vocab_size=FAMILY_VOCAB, n_positions=256
    ),
    # LayerNorm1P's weights loaded plus one; q/k norms after rope; the experts' Qwen3 attention.
    "nemotron": lambda: transformers.NemotronConfig(**_TINY, head_dim=16),
    "hunyuan": lambda: transformers.HunYuanDenseV1Config(**_TINY, head_dim=16),
    "dots1": lambda: transformers.Dots1Config(
        **{**_TINY, "num_hidden_layers": 3},
        head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=48,
        first_k_dense_replace=1,
        sliding_window=None,
    ),
    # Llama 4's query scaling by position (its original context made 8 tokens).
    "ministral3": lambda: transformers.Ministral3Config(
        **_TINY,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    # Granite 4.0's attention-only layout: the shared MLP alone.
    "granite4": lambda: transformers.GraniteMoeHybridConfig(
        **_TINY,
        layer_types=["attention"] * 2,
        num_local_experts=0,
        shared_intermediate_size=96,
        position_embedding_type="rope",
    ),
    # q/k norms over all heads (their statistics summed over the devices), sigmoid routing.
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        **{**_TINY, "intermediate_size": 48},
        head_dim=16,
        rotary_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # Sinks cut with their heads; the experts' gate|up halves cut apart; the down biases once.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**_TINY, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
    ),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_at_t2_decode_like_hf(tmp_path, name):
    # gpt-oss's sinks and router biases drawn large enough to move the tokens.
    save = {
        "gpt_oss": _save_gpt_oss,
        "glm4_moe": save_with_correction_biases,
        "minimax_m2": save_with_correction_biases,
        "dots1": save_with_correction_biases,
    }.get(name, save_random_model)
    hf_model = save(tmp_path, FAMILIES[name]())
    prompts = ragged_prompts(FAMILY_VOCAB)
    assert_matches_hf(tmp_path, hf_model, prompts, block_size=4, tensor_parallel_size=2)
