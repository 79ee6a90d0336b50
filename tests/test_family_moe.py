"""Mixtral, Qwen3-MoE and Qwen2-MoE through the engine against HF transformers, and their
routers' choices."""

import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers
from family_parity import (
    assert_hf_window_cuts,
    assert_logits_match_hf,
    assert_matches_hf,
    hf_greedy_ignoring_eos,
    ragged_prompts,
    save_random_model,
)

from jvllm.layers.moe import route
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf

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


def _qwen2_moe(**kwargs) -> transformers.Qwen2MoeConfig:
    kwargs = {"num_experts": 8, "num_experts_per_tok": 2, **kwargs}
    return transformers.Qwen2MoeConfig(
        **{**TINY, **kwargs}, moe_intermediate_size=48, shared_expert_intermediate_size=80
    )


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
    # The shared expert (width 80, gated per token) beside top-2 of 8 unrenormalised weights.
    "qwen2_moe": lambda: _qwen2_moe(),
    # Saved without layer_types (_WITHOUT_LAYER_TYPES), as the released config.json files: HF
    # then windows the even layers below max_window_layers, here layer 0 of 2 (Qwen2's rule
    # would window layer 1).
    "qwen2_moe_windowed_renormalised_top4_unbiased_tied": lambda: _qwen2_moe(
        num_experts_per_tok=4,
        norm_topk_prob=True,
        qkv_bias=False,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    ),
}
_WITHOUT_LAYER_TYPES = {"qwen2_moe_windowed_renormalised_top4_unbiased_tied"}


def _drop_layer_types(path) -> None:
    config = json.loads((path / "config.json").read_text())
    del config["layer_types"]
    (path / "config.json").write_text(json.dumps(config))


# Variants whose decode runs in the slow job (docs/testing.md): their routers are checked against
# HF's by test_router_picks_hf_experts_for_every_token in the default run.
_SLOW_DECODES = {
    "qwen3_moe_renormalised_top4",
    "qwen2_moe_windowed_renormalised_top4_unbiased_tied",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_DECODES else n for n in CONFIGS]
)
def test_moe_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    prompts = ragged_prompts(TINY["vocab_size"])
    if name in _WITHOUT_LAYER_TYPES:
        _drop_layer_types(tmp_path)
        assert_hf_window_cuts(hf_model, max(prompts, key=len))
    assert_matches_hf(tmp_path, hf_model, prompts)


# HF's experts (and Qwen2-MoE's shared expert) compute the config's hidden_act.
ACTIVATION_CONFIGS = {
    "mixtral_gelu": lambda: transformers.MixtralConfig(
        **TINY, num_local_experts=4, num_experts_per_tok=2, hidden_act="gelu"
    ),
    "qwen2_moe_gelu_tanh": lambda: _qwen2_moe(hidden_act="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("name", list(ACTIVATION_CONFIGS))
def test_experts_compute_the_configs_activation_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, ACTIVATION_CONFIGS[name]())
    token_ids = ragged_prompts(TINY["vocab_size"], lengths=(40,))[0]
    assert_logits_match_hf(tmp_path, hf_model, token_ids)


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


@pytest.mark.parametrize("num_layers,max_window_layers", [(5, 3), (4, 28), (3, 0)])
@pytest.mark.parametrize("use_sliding_window", [True, False])
def test_qwen2_moe_windows_the_layers_hf_derives_without_layer_types(
    num_layers, max_window_layers, use_sliding_window
):
    hf = _qwen2_moe(
        num_hidden_layers=num_layers,
        use_sliding_window=use_sliding_window,
        sliding_window=8,
        max_window_layers=max_window_layers,
    )
    fields = {**hf.to_dict(), "sliding_window": 8}  # HF's config holds 0 when it is unused
    del fields["layer_types"]
    config = model_config_from_hf(fields, "float32")
    windowed = use_sliding_window and hf.sliding_window
    expected = [8 if windowed and t == "sliding_attention" else None for t in hf.layer_types]
    assert list(config.layer_windows) == expected


@pytest.mark.parametrize(
    "fields,dense_layers",
    [
        ({"decoder_sparse_step": 2, "num_hidden_layers": 4}, [0, 2]),
        ({"mlp_only_layers": [1]}, [1]),
        ({"num_experts": 0}, [0, 1]),
    ],
)
def test_qwen2_moe_with_dense_mlp_layers_is_refused_naming_them(fields, dense_layers):
    hf = {**_qwen2_moe().to_dict(), **fields}
    with pytest.raises(ValueError, match=re.escape(f"make layers {dense_layers} dense MLPs")):
        model_config_from_hf(hf, "float32")


def test_qwen_moe_dense_layers_before_the_sparse_ones_decode_like_hf(tmp_path):
    """HF's dense layers (mlp_only_layers) before the sparse ones run as a stack of their own,
    then the sparse layers', at their own KV-cache layers."""
    hf_model = save_random_model(tmp_path, _qwen2_moe(num_hidden_layers=3, mlp_only_layers=[0]))
    prompts = ragged_prompts(TINY["vocab_size"], lengths=(5, 17, 40))
    assert_matches_hf(tmp_path, hf_model, prompts, max_tokens=8)


@pytest.mark.parametrize(
    "config",
    [_qwen2_moe(decoder_sparse_step=2), _qwen3_moe(mlp_only_layers=[0])],
)
def test_qwen_moe_dense_prefix_is_read_from_either_rule(config):
    fields = {**config.to_dict(), "num_hidden_layers": 2}
    assert model_config_from_hf(fields, "float32").option("num_dense_layers") == 1


def test_qwen3_moe_all_dense_config_is_refused_with_its_own_expert_count():
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
    fields = {**_qwen3_moe(mlp_only_layers=[0, 1]).to_dict(), "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=r"num_experts=8 make layers \[0, 1\] dense"):
        model_config_from_hf(fields, "float32")
    no_experts = {**_qwen3_moe().to_dict(), "num_hidden_layers": 2, "num_local_experts": 0}
    with pytest.raises(ValueError, match=r"num_experts=0 make layers \[0, 1\] dense"):
        model_config_from_hf(no_experts, "float32")


def test_qwen2_moe_mlp_only_layers_past_the_last_layer_leave_every_layer_sparse():
    hf = {**_qwen2_moe().to_dict(), "mlp_only_layers": [2, 7]}
    assert model_config_from_hf(hf, "float32").num_experts == 8  # not refused


def test_qwen2_moe_config_json_without_moe_fields_takes_hf_defaults():
    fields = {**TINY, "architectures": ["Qwen2MoeForCausalLM"], "attention_bias": True}
    config = model_config_from_hf(fields, "float32")
    hf = transformers.Qwen2MoeConfig(**TINY)
    assert config.num_experts == hf.num_experts
    assert config.num_experts_per_tok == hf.num_experts_per_tok
    assert config.moe_intermediate_size == hf.moe_intermediate_size
    assert config.shared_expert_intermediate_size == hf.shared_expert_intermediate_size
    assert config.norm_topk_prob is hf.norm_topk_prob is False
    assert config.attention_bias is hf.qkv_bias is True  # HF ignores attention_bias here
    assert not config.option("o_proj_bias", False)
    assert config.layer_windows == (None,) * TINY["num_hidden_layers"]


def test_load_weights_takes_a_transformers_models_experts_by_their_checkpoint_names(tmp_path):
    """transformers 5 holds Mixtral's experts fused in memory (experts.gate_up_proj): those
    names are refused saying how to get the checkpoint's, which load and then decode as HF's
    model does."""
    from transformers.core_model_loading import revert_weight_conversion

    from jvllm import LLM, SamplingParams

    save_random_model(tmp_path / "a", CONFIGS["mixtral"](), seed=0)
    hf_b = save_random_model(tmp_path / "b", CONFIGS["mixtral"](), seed=1)
    llm = LLM(str(tmp_path / "a"), dtype="float32", enable_sleep_mode=True, max_model_len=64)
    with pytest.raises(ValueError, match="in-memory names.*revert_weight_conversion"):
        llm.load_weights(hf_b.state_dict().items())
    llm.load_weights(revert_weight_conversion(hf_b, hf_b.state_dict()).items())
    prompt = ragged_prompts(TINY["vocab_size"])[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy_ignoring_eos(hf_b, prompt, 6)
