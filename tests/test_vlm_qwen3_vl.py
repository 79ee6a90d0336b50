"""Qwen3-VL, the model side: the tower's embeddings and DeepStack features equal HF's
get_image_features on images of two grids, its interleaved M-RoPE tables HF's rotary embedding,
and its released config reads as the checkpoint means it. The engine's greedy parity is in
tests/test_vlm_qwen2_vl_engine.py."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.numpy import load_file, save_file

from jvllm.layers.rotary import mrope_cos_sin
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.loader import load_model
from jvllm.models.model import encode_images
from jvllm.models.registry import model_class
from tests.vlm_models import _randomize

TEXT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 300,
    # 8 rotary pairs: 1, 4 and 7 take the height stream, 2 and 5 the width one (8 is past
    # the head), the rest the temporal one.
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}
# A 3-block tower with a 3 x 3 table of learned positions (resampled to larger grids) and
# DeepStack features of blocks 0 and 1.
VISION = {
    "depth": 3,
    "num_heads": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "out_hidden_size": 64,
    "patch_size": 16,
    "num_position_embeddings": 9,
    "deepstack_visual_indexes": [0, 1],
}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """(HF model, our config, our params)."""
    config = transformers.Qwen3VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=299, video_token_id=298
    )
    model = transformers.Qwen3VLForConditionalGeneration(config).float().eval()
    _randomize(model)
    path = tmp_path_factory.mktemp("qwen3_vl")
    model.save_pretrained(path)
    ours, params, _ = load_model(str(path), dtype="float32", skip_tokenizer_init=True)
    return model, ours, params


def test_image_embeddings_and_deepstack_features_equal_hf(qwen3_vl):
    model, config, params = qwen3_vl
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))
        for h, w in ((96, 160), (160, 64))
    ]
    processor_class = getattr(
        transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor
    )
    processor = processor_class(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64, patch_size=16)
    out = processor(images=images, return_tensors="np")
    pixel_values, grids = out["pixel_values"].astype(np.float32), out["image_grid_thw"]
    with torch.no_grad():
        hf = model.model.get_image_features(torch.tensor(pixel_values), torch.tensor(grids))
    family = model_class(config.architecture)
    encode = jax.jit(functools.partial(encode_images, config=config))
    starts = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])  # each image's rows
    for i, grid in enumerate(grids):
        data = {
            "pixel_values": pixel_values[starts[i] : starts[i + 1]],
            **family.image_arrays(config, grid),
        }
        ours = np.asarray(encode(params, {k: v[None] for k, v in data.items()}))[0]
        # HF's embeddings and each DeepStack level's features, image by image.
        theirs = [hf.pooler_output[i]] + [level[i] for level in hf.deepstack_features]
        theirs = np.concatenate([t.numpy() for t in theirs], axis=-1)  # [G, 3 * D]
        assert ours.shape == theirs.shape == (int(np.prod(grid)) // 4, 3 * 64)
        scale = np.abs(theirs).max()
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


def test_interleaved_mrope_tables_equal_hf(qwen3_vl):
    model, config, _ = qwen3_vl
    positions = np.random.default_rng(1).integers(0, 300, (3, 1, 12))
    with torch.no_grad():
        cos, sin = model.model.language_model.rotary_emb(
            torch.zeros(1, dtype=torch.float32), torch.tensor(positions)
        )
    ours = mrope_cos_sin(jnp.asarray(positions[:, 0]), config, (2, 3, 3), interleaved=True)
    np.testing.assert_allclose(np.asarray(ours[0]), cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours[1]), sin[0].numpy(), atol=1e-6)
    blocks = mrope_cos_sin(jnp.asarray(positions[:, 0]), config, (2, 3, 3))  # Qwen2-VL's
    assert not np.allclose(np.asarray(blocks[0]), cos[0].numpy(), atol=1e-3)


def test_qwen3_vl_moe_loads_its_fused_experts_as_released_and_as_transformers_5_saves_them(
    tmp_path,
):
    """The released checkpoints keep gate_up_proj [E, D, 2F] and down_proj [E, F, D];
    transformers 5 saves them transposed: both load as the same params."""
    text = {**TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    _randomize(model)
    saved, released = tmp_path / "saved", tmp_path / "released"
    model.save_pretrained(saved)
    tensors = load_file(str(saved / "model.safetensors"))
    assert tensors["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 24)
    transposed = {
        k: np.ascontiguousarray(v.transpose(0, 2, 1)) if ".experts." in k else v
        for k, v in tensors.items()
    }
    released.mkdir()
    save_file(transposed, str(released / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(saved / "config.json", released / "config.json")
    ours = [
        load_model(str(p), dtype="float32", skip_tokenizer_init=True) for p in (saved, released)
    ]
    assert ours[0][0] == ours[1][0] and ours[0][0].norm_topk_prob
    for a, b in zip(jax.tree.leaves(ours[0][1]), jax.tree.leaves(ours[1][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# Qwen3-VL-2B-Instruct's config.json, fields trimmed.
QWEN3_VL_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "tie_word_embeddings": True,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20]},
        "rope_theta": 5000000,
        "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 2048,
    },
}


def test_the_released_config_reads_its_text_model_tower_and_deepstack():
    config = model_config_from_hf(QWEN3_VL_2B, "bfloat16")
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (128, 8, 5e6)
    assert config.qk_norm and config.tie_word_embeddings
    assert config.option("mrope_section") == (24, 20, 20)
    assert config.option("deepstack_levels") == 3
    assert config.option("image_embed_width") == 4 * 2048
    vision = config.option("vision")
    assert (vision.patch_size, vision.num_position_embeddings) == (16, 2304)
    assert vision.hidden_act == "gelu_pytorch_tanh"
    assert model_class(config.architecture).image_num_embeds(config) == 16384
    for vision in ({"depth": 4}, {"deepstack_visual_indexes": [11, 5, 17]}):
        bad = {**QWEN3_VL_2B, "vision_config": {**QWEN3_VL_2B["vision_config"], **vision}}
        with pytest.raises(ValueError, match="deepstack_visual_indexes"):
            model_config_from_hf(bad, "bfloat16")


def test_a_moe_config_without_head_dim_takes_hidden_size_over_heads():
    """Qwen3VLMoeTextConfig's head_dim default is None (the dense one's is 128)."""
    text = {k: v for k, v in QWEN3_VL_2B["text_config"].items() if k != "head_dim"}
    text.update(num_attention_heads=32, num_experts=8, num_experts_per_tok=2)
    moe = {
        **QWEN3_VL_2B,
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "text_config": {**text, "rope_scaling": {"mrope_section": [8, 12, 12]}},
    }
    assert model_config_from_hf(moe, "bfloat16").head_dim == 2048 // 32
