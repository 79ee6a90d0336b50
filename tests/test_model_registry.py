"""The model registry and the module contract: architectures, axis names, checkpoint checks."""

import json

import jax
import pytest
import transformers
from test_model_numerics import TINY, _save_random_model
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from jvllm import LLM
from jvllm.layers.params import AXIS_NAMES
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import param_axes, param_shapes
from jvllm.models.registry import _ARCHITECTURE_BY_MODEL_TYPE, SUPPORTED_ARCHITECTURES


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    config = transformers.LlamaConfig(**TINY).to_dict()
    config["architectures"] = ["BloomForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="BloomForCausalLM") as error:
        LLM(str(tmp_path), load_format="dummy")
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)
    del config["architectures"]
    config["model_type"] = "bloom"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="without `architectures` and with model_type 'bloom'"):
        LLM(str(tmp_path), load_format="dummy")


# A SigLIP tower whose 4 x 4 patches pixel-shuffle by 2 (Idefics3's default scale_factor).
_TINY_TILE_TOWER = {
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "image_size": 56,
    "patch_size": 14,
}
# Qwen3-VL's tower, its output the text model's width (`kw`: TINY's fields).
_TINY_QWEN3_TOWER = lambda kw: {
    "depth": 2,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": kw["hidden_size"],
    "num_position_embeddings": 16,
    "deepstack_visual_indexes": [0],
}
# The HF config class of the architectures whose config.json does not use Llama's field names or
# implies settings: TINY's Llama names become the class's own through its attribute map.
_HF_CONFIG_CLASSES = {
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "GPT2LMHeadModel": transformers.GPT2Config,
    "GPTBigCodeForCausalLM": transformers.GPTBigCodeConfig,
    "OPTForCausalLM": transformers.OPTConfig,
    "MixtralForCausalLM": transformers.MixtralConfig,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
    "GPTNeoXForCausalLM": transformers.GPTNeoXConfig,
    "PhiForCausalLM": transformers.PhiConfig,
    "Starcoder2ForCausalLM": transformers.Starcoder2Config,
    "StableLmForCausalLM": transformers.StableLmConfig,
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "SmolLM3ForCausalLM": transformers.SmolLM3Config,
    "CohereForCausalLM": transformers.CohereConfig,
    "Cohere2ForCausalLM": transformers.Cohere2Config,
    "GlmForCausalLM": transformers.GlmConfig,
    "Glm4ForCausalLM": transformers.Glm4Config,
    "Dots1ForCausalLM": lambda **kw: transformers.Dots1Config(
        **kw, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1
    ),
    # One dense layer, then a MoE one with a shared expert (Glm4MoeConfig's defaults).
    "Glm4MoeForCausalLM": lambda **kw: transformers.Glm4MoeConfig(
        **kw, n_routed_experts=4, num_experts_per_tok=2
    ),
    "GPTJForCausalLM": lambda **kw: transformers.GPTJConfig(**kw, rotary_dim=8),
    "GptOssForCausalLM": transformers.GptOssConfig,
    "OlmoeForCausalLM": transformers.OlmoeConfig,
    "GraniteMoeForCausalLM": transformers.GraniteMoeConfig,
    "GraniteMoeSharedForCausalLM": transformers.GraniteMoeSharedConfig,
    # Granite 4.0's attention-only layout (its Mamba 2 layers are refused).
    "GraniteMoeHybridForCausalLM": lambda **kw: transformers.GraniteMoeHybridConfig(
        **kw, layer_types=["attention"] * kw["num_hidden_layers"]
    ),
    "FalconForCausalLM": transformers.FalconConfig,
    # A key and a value per query head (MLA); V2's layers all MoE, V3's all dense (2 < 3).
    "DeepseekV2ForCausalLM": lambda **kw: transformers.DeepseekV2Config(
        **{**kw, "num_key_value_heads": kw["num_attention_heads"], "num_experts_per_tok": 2}
    ),
    "LlavaForConditionalGeneration": lambda **kw: transformers.LlavaConfig(
        text_config=kw,
        vision_config={"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2},
        image_token_index=kw["vocab_size"] - 1,
    ),
    # Grids of tiles in multiples of the tower's image size.
    "LlavaNextForConditionalGeneration": lambda **kw: transformers.LlavaNextConfig(
        text_config=kw,
        vision_config={
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "image_size": 28,
            "patch_size": 7,
        },
        image_token_index=kw["vocab_size"] - 1,
        image_grid_pinpoints=[[28, 56], [56, 28]],
    ),
    "Idefics3ForConditionalGeneration": lambda **kw: transformers.Idefics3Config(
        text_config=kw,
        vision_config=_TINY_TILE_TOWER,
        image_token_id=kw["vocab_size"] - 1,
    ),
    "SmolVLMForConditionalGeneration": lambda **kw: transformers.SmolVLMConfig(
        text_config=kw,
        vision_config=_TINY_TILE_TOWER,
        image_token_id=kw["vocab_size"] - 1,
    ),
    "DeepseekV3ForCausalLM": lambda **kw: transformers.DeepseekV3Config(
        **{**kw, "num_key_value_heads": kw["num_attention_heads"]}
    ),
    # M-RoPE's sections sum to TINY's 8 rotary pairs a head; the tower's output is TINY's width.
    "Qwen2VLForConditionalGeneration": lambda **kw: transformers.Qwen2VLConfig(
        text_config={**kw, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
        vision_config={
            "depth": 2,
            "embed_dim": 16,
            "num_heads": 2,
            "hidden_size": kw["hidden_size"],
        },
        image_token_id=kw["vocab_size"] - 1,
    ),
    "Qwen3VLForConditionalGeneration": lambda **kw: transformers.Qwen3VLConfig(
        text_config={
            **kw,
            "head_dim": kw["hidden_size"] // kw["num_attention_heads"],
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        },
        vision_config=_TINY_QWEN3_TOWER(kw),
        image_token_id=kw["vocab_size"] - 1,
    ),
    "Mistral3ForConditionalGeneration": lambda **kw: transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**kw),
        vision_config={"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2},
        image_token_index=kw["vocab_size"] - 1,
    ),
    "Qwen3VLMoeForConditionalGeneration": lambda **kw: transformers.Qwen3VLMoeConfig(
        text_config={
            **kw,
            "head_dim": kw["hidden_size"] // kw["num_attention_heads"],
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        vision_config=_TINY_QWEN3_TOWER(kw),
        image_token_id=kw["vocab_size"] - 1,
    ),
    "Qwen2_5_VLForConditionalGeneration": lambda **kw: transformers.Qwen2_5_VLConfig(
        text_config={**kw, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": kw["hidden_size"],
            "fullatt_block_indexes": [1],
        },
        image_token_id=kw["vocab_size"] - 1,
    ),
}


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_param_names_each_of_its_axes(architecture):
    hf = _HF_CONFIG_CLASSES.get(architecture, dict)(**TINY)
    fields = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    config = model_config_from_hf({**fields, "architectures": [architecture]}, "float32")
    shapes, axes = param_shapes(config), param_axes(config)
    is_axes = lambda x: isinstance(x, tuple)
    assert jax.tree.structure(shapes) == jax.tree.structure(axes, is_leaf=is_axes)
    for spec, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=is_axes)):
        assert len(names) == len(spec.shape) and set(names) <= set(AXIS_NAMES)
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    if architecture.startswith("Deepseek"):  # MLA; a dense stack, then a MoE one
        stack = axes.get("moe_layers") or axes["dense_layers"]
        assert stack["attn"]["kv_b"]["weight"] == ("layers", "heads", "embed")
        assert stack["attn"]["o"]["weight"] == ("layers", "embed", "heads")
        return
    assert axes["layers"]["attn"]["qkv"]["weight"] == ("layers", "heads", "embed")
    if config.num_experts:
        assert axes["layers"]["mlp"]["down"] == ("layers", "experts", "mlp", "embed")
        assert axes["layers"]["mlp"]["router"] == ("layers", "experts", "embed")
    else:
        assert axes["layers"]["mlp"]["down"]["weight"] == ("layers", "embed", "mlp")
    if config.shared_expert_intermediate_size:  # column- then row-parallel, as a dense MLP
        mlp = axes["layers"]["mlp"]
        shared = mlp.get("shared_expert") or mlp["shared_experts"]  # Qwen2-MoE's, GLM-4.5's
        assert shared["gate_up"]["weight"] == ("layers", "mlp", "embed")
        assert shared["down"]["weight"] == ("layers", "embed", "mlp")
        if "shared_gate" in mlp:  # Qwen2-MoE's gate on it
            assert mlp["shared_gate"] == ("layers", "embed")  # replicated
    num_layers = config.num_layers - config.option("num_dense_layers", 0)
    assert shapes["layers"]["attn"]["qkv"]["weight"].shape[0] == num_layers


# Each supported architecture's model_type, as HF's causal-LM registry names it; jvllm's own
# where several do (SarvamMoE's model_type runs Glm4MoeForCausalLM too).
_MODEL_TYPES = {
    **{architecture: t for t, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()},
    **{
        architecture: t
        for t, architecture in _ARCHITECTURE_BY_MODEL_TYPE.items()
        if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t) == architecture
    },
}


# The families whose config class this test cannot build with its head counts, and why.
_NO_KV_HEADS_DEFAULT = {
    "GraniteMoeHybridForCausalLM": "its config class checks Mamba 2 sizes against the heads",
    "GPTBigCodeForCausalLM": "multi_query, not num_key_value_heads, sets its KV heads",
    "Dots1ForCausalLM": "its config class leaves the experts None, which no model runs",
}


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_a_config_json_without_num_key_value_heads_takes_hfs_default(architecture):
    """Some config classes default to a fixed KV head count (GLM's 2, Mixtral's 8, Qwen3's 32,
    ...) where the others take the query heads' count."""
    if architecture not in _MODEL_TYPES:
        pytest.skip("a multimodal checkpoint: its text_config reads as its text family's")
    config_class = transformers.CONFIG_MAPPING[_MODEL_TYPES[architecture]]
    if architecture in _NO_KV_HEADS_DEFAULT:
        pytest.skip(_NO_KV_HEADS_DEFAULT[architecture])
    hf = config_class(**TINY).to_dict()
    hf.pop("num_key_value_heads", None)
    expected = getattr(config_class(**hf), "num_key_value_heads", None)  # HF reading the JSON
    if expected is None:
        pytest.skip("the config class reads no num_key_value_heads")
    if architecture.startswith("Deepseek"):
        pytest.skip("MLA has a key and a value per query head, whatever the default")
    # Twice as many query heads as HF's default KV heads (at least 8): the default divides them
    # and differs from them, so that a config read as "KV heads = query heads" shows.
    num_heads = 2 * max(expected, hf["num_attention_heads"])
    hf.update(num_attention_heads=num_heads, head_dim=16, hidden_size=16 * num_heads)
    config = model_config_from_hf({**hf, "architectures": [architecture]}, "float32")
    assert config.num_kv_heads == config_class(**hf).num_key_value_heads


def test_checkpoint_that_does_not_match_its_config_names_the_tensor(tmp_path):
    _save_random_model(tmp_path, transformers.LlamaConfig(**TINY))
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96  # the saved MLP weights are 128 wide
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_hf_dir(str(tmp_path), "float32")
