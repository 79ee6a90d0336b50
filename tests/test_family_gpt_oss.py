"""gpt-oss through the engine against HF transformers, and its MXFP4-packed experts dequantized
as HF dequantizes them."""

import json

import numpy as np
import pytest
import torch
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_hf_window_cuts,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from jvllm.layers.gpt_oss_moe import split_interleaved
from jvllm.layers.rotary import inverse_frequencies
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.mxfp4 import dequantize_mxfp4

_EXPERTS = "model.layers.{}.mlp.experts."


def _gpt_oss(**kwargs) -> transformers.GptOssConfig:
    """2 layers: sliding (window 4, which the ragged prompts pass) then full; 4 experts, top 2;
    expert F 32 (one MXFP4 block); the release's YaRN rope. swiglu_limit 1 where the release has
    7, so that the clamps cut the random model's activations."""
    fields = {
        **TINY_SHAPES,
        "head_dim": 16,
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "swiglu_limit": 1.0,
        **kwargs,
    }
    return transformers.GptOssConfig(**fields)


def _save_gpt_oss(path, config) -> torch.nn.Module:
    """save_random_model's weights, with sinks and router biases of O(1), so that each moves
    the outputs (the sinks take a large share of attention; the biases change the experts)."""
    model = save_random_model(path, config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
            layer.mlp.router.bias.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def test_gpt_oss_decodes_like_hf(tmp_path):
    hf_model = _save_gpt_oss(tmp_path, _gpt_oss())
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"])
    assert_hf_window_cuts(hf_model, max(prompts, key=len))
    assert_matches_hf(tmp_path, hf_model, prompts, max_tokens=8)  # HF's MoE is slow on CPU


def _random_packed(rng, *shape) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 blocks u8[*shape, 16] and scales u8[*shape] of random bytes."""
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return blocks, rng.integers(0, 256, shape, dtype=np.uint8)


def test_mxfp4_dequantizes_bit_for_bit_like_hf():
    """Every nibble and every exponent (the largest overflow to inf, the smallest to zero)."""
    blocks, scales = _random_packed(np.random.default_rng(0), 3, 64, 2)
    expected = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()
    with np.errstate(over="ignore"):
        got = dequantize_mxfp4(blocks, scales)
    assert got.shape == expected.shape == (3, 64, 64)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_mxfp4_checkpoint_loads_its_experts_dequantized(tmp_path):
    """A checkpoint whose experts are MXFP4-packed (as openai/gpt-oss-*'s) loads them as HF's
    dequantization gives them, gate and up split apart, and reads every packed tensor."""
    config = _gpt_oss()
    save_random_model(tmp_path, config)
    tensors = load_file(tmp_path / "model.safetensors")
    rng = np.random.default_rng(1)
    d, f, e = config.hidden_size, config.intermediate_size, config.num_local_experts
    expected = {}
    for i in range(config.num_hidden_layers):
        for name, (rows, cols) in {"gate_up_proj": (2 * f, d), "down_proj": (d, f)}.items():
            del tensors[_EXPERTS.format(i) + name]
            blocks, scales = _random_packed(rng, e, rows, cols // 32)
            scales = scales % 16 + 119  # the release's range: no inf or NaN
            tensors[_EXPERTS.format(i) + name + "_blocks"] = blocks
            tensors[_EXPERTS.format(i) + name + "_scales"] = scales
            hf = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            ).numpy()
            expected[name, i] = split_interleaved(hf) if name == "gate_up_proj" else hf
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))

    _, params = load_hf_dir(str(tmp_path), "float32")
    for (name, i), values in expected.items():
        ours = params["layers"]["mlp"]["gate_up" if name == "gate_up_proj" else "down"][i]
        np.testing.assert_array_equal(np.asarray(ours), values)


def test_gpt_oss_rope_is_hfs_yarn_untruncated():
    """The release's YaRN (truncate false): HF's frequencies and cos/sin scale, which the
    parity prompts are too short to tell from the truncated ones."""
    hf_config = _gpt_oss()
    hf_rope = GptOssRotaryEmbedding(hf_config)
    config = model_config_from_hf(hf_config.to_dict(), "float32")
    np.testing.assert_allclose(inverse_frequencies(config), hf_rope.inv_freq.numpy(), rtol=1e-6)
    assert config.rope_scaling.attention_factor == pytest.approx(hf_rope.attention_scaling)


def test_gpt_oss_config_reads_hf_defaults_and_refuses_other_quantization():
    fields = {**_gpt_oss().to_dict(), "num_hidden_layers": 3}
    for key in ("layer_types", "rope_parameters", "swiglu_limit", "sliding_window"):
        del fields[key]
    config = model_config_from_hf(fields, "float32")
    assert config.layer_windows == (128, None, 128)
    assert config.rope_theta == 150000.0
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
    assert config.option("swiglu_limit") == 7.0
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        model_config_from_hf({**fields, "quantization_config": {"quant_method": "gptq"}}, "float32")
