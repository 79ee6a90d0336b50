"""Mixtral and Qwen3-MoE through the engine against HF transformers, and their routers' choices."""

import jax
import numpy as np
import pytest
import torch
import transformers
from family_parity import assert_matches_hf, ragged_prompts, save_random_model

from jvllm.layers.moe import route
from jvllm.model_loader.hf import load_hf_dir

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}


def _qwen3_moe(**kwargs) -> transformers.Qwen3MoeConfig:
    kwargs = {"num_experts": 8, "num_experts_per_tok": 2, **kwargs}
    return transformers.Qwen3MoeConfig(**TINY, head_dim=32, moe_intermediate_size=48, **kwargs)


CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: _qwen3_moe(),
    "qwen3_moe_renormalised_top4": lambda: _qwen3_moe(num_experts_per_tok=4, norm_topk_prob=True),
    # HF windows every layer of a Qwen3-MoE (max_window_layers is Qwen2's and Qwen3's), and
    # attention_bias puts biases on o_proj too.
    "qwen3_moe_windowed_biased": lambda: _qwen3_moe(
        num_experts=4,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        attention_bias=True,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_router_picks_hf_experts_for_every_token(tmp_path, name):
    """Each layer's router, as loaded, picks HF's experts for every token of a prompt, given
    the same input (HF's own, captured at each MoE block)."""
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    config, params = load_hf_dir(str(tmp_path), "float32")
    inputs = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _, args: inputs.append(args[0][0].numpy()))
        for layer in hf_model.model.layers
    ]
    prompt = ragged_prompts(TINY["vocab_size"], lengths=(40,))[0]
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), output_router_logits=True)
    for hook in hooks:
        hook.remove()
    k = config.num_experts_per_tok
    for layer, (x, hf_logits) in enumerate(zip(inputs, out.router_logits)):
        router = params["layers"]["mlp"]["router"][layer]
        weights, experts = jax.jit(route, static_argnums=(2, 3))(
            x, router, k, config.norm_topk_prob
        )
        hf_top = torch.topk(hf_logits.float().softmax(-1), k, dim=-1)
        for t in range(len(prompt)):
            assert set(np.asarray(experts[t])) == set(hf_top.indices[t].tolist()), (layer, t)
        hf_weights = hf_top.values
        if config.norm_topk_prob:
            hf_weights = hf_weights / hf_weights.sum(-1, keepdim=True)
        np.testing.assert_allclose(
            np.sort(np.asarray(weights), -1), np.sort(hf_weights.numpy(), -1), atol=1e-5
        )
