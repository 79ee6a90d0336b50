"""Our pure-JAX Llama-family forward vs HF transformers on tiny random checkpoints."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import dense_logits
from transformers.activations import ACT2FN

from jvllm.config import SUPPORTED_ACTIVATIONS
from jvllm.layers.activation import ACTIVATIONS
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import param_shapes

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny model's frequencies fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}


def _save_random_model(tmp_path, config, seed=0, **save_kwargs):
    """Save an HF model whose every weight (biases and norms too) is random and O(0.1), so that
    a wrong bias, norm or permutation cannot hide behind HF's zero/one initialisation."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path, **save_kwargs)
    return model


def _our_logits(path, token_ids, positions, dtype="float32"):
    config, params = load_hf_dir(str(path), dtype)
    return config, dense_logits(config, params, token_ids, positions)


def _hf_logits(model, token_ids, positions):
    with torch.no_grad():
        out = model(torch.tensor(token_ids)[None], position_ids=torch.tensor(positions)[None])
    return out.logits[0].float().numpy()


def _configs():
    cases = {
        "llama": transformers.LlamaConfig(**TINY),
        "llama_tied": transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
        "llama3_rope": transformers.LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
        "mistral": transformers.MistralConfig(**TINY),
        "qwen2_bias": transformers.Qwen2Config(**TINY),
    }
    if hasattr(transformers, "Qwen3Config"):
        cases["qwen3_qk_norm"] = transformers.Qwen3Config(**TINY, head_dim=16)
    return cases


@pytest.mark.parametrize("name", list(_configs()))
def test_forward_matches_hf_logits(tmp_path, name):
    hf_config = _configs()[name]
    model = _save_random_model(tmp_path, hf_config)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, TINY["vocab_size"], size=12).astype(np.int32)
    # Positions far from 0 exercise RoPE (and llama3 scaling) beyond the first few angles.
    positions = np.arange(100, 112, dtype=np.int32)
    _, ours = _our_logits(tmp_path, token_ids, positions)
    np.testing.assert_allclose(ours, _hf_logits(model, token_ids, positions), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2_bias", "qwen3_qk_norm"])
def test_param_shapes_describe_what_the_loader_builds(tmp_path, name, dtype):
    if name not in _configs():
        pytest.skip("this transformers has no Qwen3")
    _save_random_model(tmp_path, _configs()[name])
    config, params = load_hf_dir(str(tmp_path), dtype)
    loaded = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    declared = jax.tree.map(lambda x: (x.shape, x.dtype), param_shapes(config))
    assert jax.tree.structure(loaded) == jax.tree.structure(declared)
    assert jax.tree.leaves(loaded) == jax.tree.leaves(declared)


def test_config_flags_follow_architecture():
    configs = _configs()
    qwen2 = model_config_from_hf(configs["qwen2_bias"], "float32")
    assert qwen2.attention_bias and not qwen2.qk_norm
    llama3 = model_config_from_hf(configs["llama3_rope"], "float32")
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 8.0
    assert model_config_from_hf(configs["llama_tied"], "float32").tie_word_embeddings
    hash(llama3)  # static argument of jax.jit


def test_sharded_bfloat16_checkpoint_loads_in_bfloat16(tmp_path):
    model = _save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    token_ids = np.arange(10, dtype=np.int32)
    positions = np.arange(10, dtype=np.int32)
    config, ours = _our_logits(tmp_path, token_ids, positions, dtype="auto")
    assert config.dtype == "bfloat16"
    reference = _hf_logits(model.float(), token_ids, positions)  # bf16 weights, f32 math
    np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-2)


def test_unsupported_architecture_and_bad_fields_are_named():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        model_config_from_hf({"architectures": ["BloomForCausalLM"]}, "float32")
    bad_heads = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_kv_heads"):
        model_config_from_hf(bad_heads, "float32")


def test_each_activation_a_config_accepts_has_its_function():
    assert tuple(ACTIVATIONS) == SUPPORTED_ACTIVATIONS


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_each_activation_computes_hfs_function_of_its_name(name):
    x = np.linspace(-12.0, 12.0, 193, dtype=np.float32)
    expected = ACT2FN[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(ACTIVATIONS[name](x)), expected, rtol=1e-5, atol=1e-5)
