"""DeepSeek-V2 and V3 (multi-head latent attention, dense layers then experts) through the
engine against HF transformers, and their routers against HF's."""

import re

import jax
import numpy as np
import pytest
import torch
import transformers
from family_parity import (
    assert_logits_match_hf,
    assert_matches_hf,
    ragged_prompts,
    save_with_correction_biases,
)

from jvllm import LLM, SamplingParams
from jvllm.attention import pallas as pallas_backend
from jvllm.distributed.tensor_parallel import check_tensor_parallel
from jvllm.layers.deepseek_moe import deepseek_route
from jvllm.layers.scan import UNSTACKED_LAYERS_ENV
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.deepseek import MLA_DISABLE_ENV

# 1 dense layer then MoE layers; the value head (16) is narrower than the key's 16 + 8.
TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}
# YaRN with DeepSeek's mscale: cos/sin scale by mscale(4, 1) / mscale(4, 0.8), the softmax by
# mscale(4, 0.8)^2 (1.23).
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def v2_lite_like(**kwargs) -> transformers.DeepseekV2Config:
    """DeepSeek-V2-Lite's layout: q_proj (no q latent), greedy softmax routing, 2 shared
    experts; tied embeddings."""
    kwargs = {
        "num_hidden_layers": 3,
        "q_lora_rank": None,
        "topk_method": "greedy",
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.5,
        "tie_word_embeddings": True,
        **kwargs,
    }
    return transformers.DeepseekV2Config(**{**TINY, **kwargs})


def v3_like(**kwargs) -> transformers.DeepseekV3Config:
    """DeepSeek-V3's layout: a q latent, sigmoid routing with a correction bias over 2 groups
    of 4 (the best group only), renormalised and scaled by 2.5, one shared expert, YaRN;
    biases on q_a, kv_a and o."""
    kwargs = {
        "num_hidden_layers": 2,
        "q_lora_rank": 32,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "attention_bias": True,
        "rope_parameters": YARN,
        **kwargs,
    }
    return transformers.DeepseekV3Config(**{**TINY, **kwargs})


_save = save_with_correction_biases  # other tests' name for it


# HF's DeepSeek generates slowly on CPU: fewer and shorter prompts than the other families'.
PROMPTS = ragged_prompts(TINY["vocab_size"], lengths=(5, 17, 40))


def test_deepseek_v2_lite_like_decodes_like_hf(tmp_path):
    hf_model = _save(tmp_path, v2_lite_like())
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_deepseek_v3_like_decodes_like_hf(tmp_path):
    hf_model = _save(tmp_path, v3_like())
    assert_matches_hf(tmp_path, hf_model, PROMPTS, max_tokens=8)


def test_experts_and_dense_mlps_compute_the_configs_activation_like_hf(tmp_path):
    hf_model = _save(tmp_path, v2_lite_like(hidden_act="gelu_pytorch_tanh"))
    assert_logits_match_hf(tmp_path, hf_model, PROMPTS[-1])


@pytest.mark.slow  # 30 s cold; test_deepseek_v3_like_decodes_like_hf keeps V3 in the default run
def test_deepseek_v3_unstacked_rotate_half_decodes_like_hf(tmp_path, monkeypatch):
    """The layers split per layer (the GPU layout) across the two stacks, and V3 without
    rope_interleave."""
    monkeypatch.setenv(UNSTACKED_LAYERS_ENV, "1")
    hf_model = _save(tmp_path, v3_like(num_hidden_layers=3, rope_interleave=False))
    assert_matches_hf(tmp_path, hf_model, PROMPTS[:2], max_tokens=8)


_V2 = transformers.models.deepseek_v2.modeling_deepseek_v2
_V3 = transformers.models.deepseek_v3.modeling_deepseek_v3
# name -> (config, HF's router class, jvllm's routing); the group-limited one keeps the single
# best of 4 groups of 2, so that it differs from greedy whenever the best 2 are in 2 groups.
ROUTERS = {
    "greedy": (v2_lite_like, _V2.DeepseekV2TopkRouter),
    "group_limited_greedy": (
        lambda: v2_lite_like(topk_method="group_limited_greedy", n_group=4, topk_group=1),
        _V2.DeepseekV2TopkRouter,
    ),
    "noaux_tc": (v3_like, _V3.DeepseekV3TopkRouter),
}


def _sorted_by_expert(weights, experts) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(np.asarray(experts), axis=-1)
    take = lambda a: np.take_along_axis(np.asarray(a), order, axis=-1)
    return take(weights), take(experts)


@pytest.mark.parametrize("routing", list(ROUTERS))
def test_router_picks_hf_experts_with_hf_weights(routing):
    make_config, router_class = ROUTERS[routing]
    config = make_config()
    router = router_class(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0.0, 0.3)
        logits, hf_weights, hf_experts = router(torch.randn(64, config.hidden_size))
    weights, experts = deepseek_route(
        jax.numpy.asarray(logits.numpy()),
        None if bias is None else jax.numpy.asarray(bias.numpy()),
        routing=routing,
        top_k=config.num_experts_per_tok,
        num_groups=config.n_group or 1,
        topk_group=config.topk_group or 1,
        renormalize=routing == "noaux_tc",
        scaling_factor=config.routed_scaling_factor,
    )
    weights, experts = _sorted_by_expert(weights, experts)
    hf_weights, hf_experts = _sorted_by_expert(hf_weights.numpy(), hf_experts.numpy())
    np.testing.assert_array_equal(experts, hf_experts)
    np.testing.assert_allclose(weights, hf_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_config,fields,message",
    [
        (v2_lite_like, {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        (v2_lite_like, {"norm_topk_prob": True}, "norm_topk_prob=True"),
        (v3_like, {"moe_layer_freq": 2}, "moe_layer_freq=2"),
        (v3_like, {"num_key_value_heads": 2}, "num_key_value_heads=2"),
        (v3_like, {"n_group": 3}, "n_group must be a positive int dividing"),
    ],
)
def test_unsupported_deepseek_config_is_refused_naming_the_field(make_config, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model_config_from_hf({**make_config().to_dict(), **fields}, "float32")


def test_deepseek_config_reads_hf_semantics(monkeypatch):
    """The latent cache holds one row of kv_lora_rank + qk_rope (24 + 8) a token and layer; the
    decompressed one N heads of the key's dims (16 + 8, wider than the value's 16) in two
    planes; the softmax scale is 24^-1/2 times mscale(4, 0.8)^2 either way; V3's dense layers
    come first."""
    hf = v3_like(num_hidden_layers=3).to_dict()
    config = model_config_from_hf(hf, "float32")
    assert (config.head_dim, config.num_kv_heads, config.kv_planes) == (32, 1, 1)
    monkeypatch.setenv(MLA_DISABLE_ENV, "1")
    decompressed = model_config_from_hf(hf, "float32")
    assert (decompressed.head_dim, decompressed.num_kv_heads, decompressed.kv_planes) == (24, 4, 2)
    assert config.sm_scale == decompressed.sm_scale
    assert config.sm_scale == pytest.approx(24**-0.5 * (0.1 * 0.8 * np.log(4) + 1) ** 2)
    assert config.option("first_k_dense_replace") == 1 and config.num_experts == 8
    dense = model_config_from_hf(v3_like(first_k_dense_replace=5).to_dict(), "float32")
    assert dense.num_experts == 0  # every layer dense: no routing settings are read


def _greedy_with_logprobs(path, prompts, **engine_kwargs):
    llm = LLM(
        str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=32, **engine_kwargs
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    outputs = [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    logprobs = [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids)] for o in outputs]
    return [o.token_ids for o in outputs], np.array(logprobs), llm


def _kv_bytes_per_token(llm) -> int:
    cache = llm.llm_engine.worker.model_runner.kv_cache  # [L, V, K, P, B, H]
    return cache.nbytes // (cache.shape[3] * cache.shape[4])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_latent_cache_decodes_as_the_decompressed_one(tmp_path, monkeypatch, kv_cache_dtype):
    """The latent path (absorbed projections, one cached row a token) gives the decompressed
    path's tokens and logprobs, through chunked prefill and decode, in 1/(2N(P+R)/(C+R)) of its
    cache: 2 x 4 x 24 / 32 = 6x less here (85x at DeepSeek-V3's shapes)."""
    _save(tmp_path, v3_like())
    prompts = PROMPTS[:2]
    tokens, logprobs, llm = _greedy_with_logprobs(tmp_path, prompts, kv_cache_dtype=kv_cache_dtype)
    latent_bytes = _kv_bytes_per_token(llm) if kv_cache_dtype == "auto" else None
    monkeypatch.setenv(MLA_DISABLE_ENV, "1")
    expected, expected_logprobs, llm = _greedy_with_logprobs(
        tmp_path, prompts, kv_cache_dtype=kv_cache_dtype
    )
    assert tokens == expected
    tolerance = 1e-4 if kv_cache_dtype == "auto" else 0.1  # int8 rounds other numbers
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=tolerance)
    if kv_cache_dtype == "auto":
        assert _kv_bytes_per_token(llm) == 6 * latent_bytes


@pytest.mark.slow  # the Pallas kernels interpreted on CPU over two generates
def test_latent_cache_on_the_pallas_backend_decodes_as_the_reference(tmp_path, monkeypatch):
    """Decode steps run the MLA kernel (one read of each row; a latent of 32 and rope dims of
    16, powers of two as it takes), the others the ragged kernel over the one-plane cache."""
    _save(tmp_path, v3_like(kv_lora_rank=32, qk_rope_head_dim=16))
    calls = []
    kernel = pallas_backend.mla_decode_attention
    monkeypatch.setattr(
        pallas_backend,
        "mla_decode_attention",
        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
    )
    pallas, pallas_logprobs, _ = _greedy_with_logprobs(
        tmp_path, PROMPTS, attention_backend="pallas"
    )
    assert calls  # traced for the decode buckets
    reference, reference_logprobs, _ = _greedy_with_logprobs(tmp_path, PROMPTS)
    assert pallas == reference
    np.testing.assert_allclose(pallas_logprobs, reference_logprobs, atol=1e-4)


def test_act_order_kv_b_absorbed_in_the_checkpoints_column_order(tmp_path, monkeypatch):
    """A GPTQ act-order checkpoint stores kv_b's columns sorted by group: the latent path,
    which multiplies kv_b itself, must put them back in the latent's order."""
    from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint

    source, quantized = tmp_path / "float", tmp_path / "gptq"
    _save(source, v2_lite_like(kv_lora_rank=32))
    quantize_checkpoint(str(source), str(quantized), "gptq", group_size=8, desc_act=True)
    tokens, logprobs, _ = _greedy_with_logprobs(quantized, PROMPTS[:2])
    monkeypatch.setenv(MLA_DISABLE_ENV, "1")
    expected, expected_logprobs, _ = _greedy_with_logprobs(quantized, PROMPTS[:2])
    assert tokens == expected
    np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-4)


def test_tensor_parallelism_refuses_a_dense_width_it_does_not_divide():
    config = model_config_from_hf(v3_like(intermediate_size=90).to_dict(), "float32")
    with pytest.raises(ValueError, match="the dense layers' intermediate size 90"):
        check_tensor_parallel(config, 4)


def test_only_the_family_sets_the_caches_planes():
    """A config.json or hf_overrides naming kv_planes cannot drop a Llama's values."""
    hf = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64
    ).to_dict()
    assert model_config_from_hf({**hf, "kv_planes": 1}, "float32").kv_planes == 2
