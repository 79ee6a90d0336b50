"""Qwen2-VL and Qwen2.5-VL, the model side: the vision tower, M-RoPE positions and the forward
with images equal HF transformers' on tiny random checkpoints, and both checkpoint layouts
load."""

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import dense_forward_logits
from PIL import Image
from safetensors.numpy import load_file, save_file

from jvllm.layers.image_embeds import ImageEmbeds
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.loader import load_model
from jvllm.models import qwen2_vl_vision
from jvllm.models.model import encode_images, forward
from jvllm.models.registry import model_class
from tests.vlm_models import _randomize

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 299, 298, 297, 296
TEXT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # Head dim 16: 8 rotary pairs, 2 turned by the temporal stream, 3 by each spatial one.
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}
VISION = {"depth": 2, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}
FAMILIES = {
    "qwen2_vl": (
        transformers.Qwen2VLConfig,
        transformers.Qwen2VLForConditionalGeneration,
        {**VISION, "embed_dim": 32, "mlp_ratio": 2, "hidden_size": 64},
    ),
    # Windows of 56 px: 2 x 2 merged patches, so each image has several; layer 0 windowed.
    "qwen2_5_vl": (
        transformers.Qwen2_5_VLConfig,
        transformers.Qwen2_5_VLForConditionalGeneration,
        {
            **VISION,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    ),
}
# Images of at most 64 merged patches (256 patches): 140 x 196 px is 10 x 14 patches, 250 x 120
# px becomes 252 x 112, 18 x 8 patches.
MAX_PIXELS = 28 * 28 * 64
IMAGE_SIZES = [(140, 196), (250, 120), (140, 196)]


def _hf_config(family: str):
    config_class, _, vision = FAMILIES[family]
    return config_class(
        text_config=TEXT,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )


@dataclasses.dataclass(frozen=True)
class _ImageEmbeds:
    """ImageEmbeds with rope_positions, where layers/image_embeds.py has no such field yet."""

    embeds: jax.Array
    is_embed: jax.Array
    rope_positions: jax.Array

    def merge(self, x):
        return ImageEmbeds(self.embeds, self.is_embed).merge(x)


def _image_embeds(embeds, is_embed, rope_positions):
    if "rope_positions" in {f.name for f in dataclasses.fields(ImageEmbeds)}:
        return ImageEmbeds(embeds, is_embed, rope_positions=rope_positions)
    return _ImageEmbeds(embeds, is_embed, rope_positions)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family name, HF model, checkpoint dir, our config, our params)."""
    name = request.param
    model = FAMILIES[name][1](_hf_config(name)).float().eval()
    _randomize(model)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    config, params, _ = load_model(str(path), dtype="float32", skip_tokenizer_init=True)
    return name, model, path, config, params


@pytest.fixture(scope="module")
def images():
    """The processor's pixel_values f32[sum P, K] and image_grid_thw i32[3 images, 3]."""
    rng = np.random.default_rng(0)
    pil = [Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)) for h, w in IMAGE_SIZES]
    processor_class = getattr(
        transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor
    )
    processor = processor_class(min_pixels=28 * 28 * 4, max_pixels=MAX_PIXELS)
    out = processor(images=pil, return_tensors="np")
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"]


def _hf_features(model, pixel_values, grids) -> list[np.ndarray]:
    with torch.no_grad():
        out = model.model.get_image_features(torch.tensor(pixel_values), torch.tensor(grids))
    return [f.numpy() for f in out.pooler_output]


def _encode(config, params, pixel_values, grids, indices, **replace) -> np.ndarray:
    """Our embeddings f32[N, G, D] of the images `indices` (of one grid), encoded as one batch,
    each array of image_arrays' replaced by `replace`'s function of it where given."""
    family_class = model_class(config.architecture)
    starts = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])
    per_image = []
    for i in indices:
        arrays = family_class.image_arrays(config, grids[i])
        arrays = {k: replace.get(k, lambda a: a)(v) for k, v in arrays.items()}
        per_image.append({"pixel_values": pixel_values[starts[i] : starts[i + 1]], **arrays})
    data = {k: np.stack([d[k] for d in per_image]) for k in per_image[0]}
    run = jax.jit(functools.partial(encode_images, config=config))
    return np.asarray(run(params, data))


def _prompt(grids, config) -> list[int]:
    """Text, an image, text, another image and text after it, as Qwen's chat template lays
    images out (each between vision start and end tokens)."""
    family_class = model_class(config.architecture)
    counts = [family_class.image_num_embeds_for(config, g) for g in grids]
    return (
        [5, 17, 42, VISION_START_ID]
        + [IMAGE_TOKEN_ID] * counts[0]
        + [VISION_END_ID, 7, 99, VISION_START_ID]
        + [IMAGE_TOKEN_ID] * counts[1]
        + [VISION_END_ID, 11, 12, 13, 14]
    )


@pytest.mark.slow  # the engine's greedy parity and the forward test cover it
def test_encode_images_equals_hf_image_features_for_each_image(family, images):
    _, model, _, config, params = family
    pixel_values, grids = images
    expected = _hf_features(model, pixel_values, grids)
    # Images 0 and 2 have one grid: one batch of two; image 1 alone.
    batch = _encode(config, params, pixel_values, grids, [0, 2])
    alone = _encode(config, params, pixel_values, grids, [1])
    for ours, theirs in zip([batch[0], alone[0], batch[1]], expected):
        assert ours.shape == theirs.shape
        scale = np.abs(theirs).max()
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.slow  # the engine's greedy parity and the forward test cover it
def test_attention_in_query_chunks_equals_hf(family, images, monkeypatch):
    """The tower's attention takes its queries a chunk at a time (bounding its scores for large
    images): 48 a chunk cuts each image's 140 or 144 patches into 3, the last one padded."""
    _, model, _, config, params = family
    pixel_values, grids = images
    monkeypatch.setattr(qwen2_vl_vision, "_QUERY_CHUNK", 48)
    expected = _hf_features(model, pixel_values, grids)
    for i in range(2):
        ours = _encode(config, params, pixel_values, grids, [i])[0]
        scale = np.abs(expected[i]).max()
        np.testing.assert_allclose(ours, expected[i], rtol=1e-5, atol=1e-5 * scale)


def test_qwen2_5_vl_windowed_layers_attend_within_their_windows(family, images):
    name, model, _, config, params = family
    if name != "qwen2_5_vl":
        pytest.skip("Qwen2-VL has no windowed layers")
    pixel_values, grids = images
    expected = _hf_features(model, pixel_values, grids)[1]
    # Every layer full: the windowed layer attending to the whole image gives other features.
    unwindowed = _encode(config, params, pixel_values, grids, [1], window_segments=np.zeros_like)[0]
    assert np.abs(unwindowed - expected).max() > 1e-2 * np.abs(expected).max()


def test_mrope_positions_equal_hf_get_rope_index(family, images):
    _, model, _, config, _ = family
    _, grids = images
    grids = grids[:2]
    family_class = model_class(config.architecture)
    token_ids = _prompt(grids, config)
    ours, delta = family_class.mrope_positions(config, token_ids, [tuple(g) for g in grids])
    # Three more text tokens: theirs continue at index i + delta in all three streams.
    extended = token_ids + [20, 21, 22]
    ids = torch.tensor([extended])
    with torch.no_grad():
        theirs, theirs_delta = model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(), image_grid_thw=torch.tensor(grids)
        )
    theirs = theirs[:, 0].numpy()
    assert ours.dtype == np.int32 and ours.shape == (3, len(token_ids))
    np.testing.assert_array_equal(ours, theirs[:, : len(token_ids)])
    assert delta == int(theirs_delta) == theirs.max() + 1 - len(extended)
    after = np.arange(len(token_ids), len(extended)) + delta
    np.testing.assert_array_equal(theirs[:, len(token_ids) :], np.stack([after] * 3))


def test_mrope_positions_refuse_image_tokens_that_do_not_fit_the_grids(family):
    _, _, _, config, _ = family
    family_class = model_class(config.architecture)
    grid = (1, 4, 6)  # 6 image tokens
    with pytest.raises(ValueError, match="takes 6 image tokens"):
        family_class.mrope_positions(config, [1] + [IMAGE_TOKEN_ID] * 5 + [2], [grid])
    with pytest.raises(ValueError, match="more image tokens"):
        family_class.mrope_positions(config, [IMAGE_TOKEN_ID] * 12, [grid])
    with pytest.raises(ValueError, match="fewer than its 2 images"):
        family_class.mrope_positions(config, [IMAGE_TOKEN_ID] * 6, [grid, grid])
    positions, delta = family_class.mrope_positions(config, [3, 4, 5], [])
    np.testing.assert_array_equal(positions, np.stack([np.arange(3)] * 3))
    assert delta == 0


def test_forward_with_images_equals_hf_logits(family, images):
    _, model, _, config, params = family
    pixel_values, grids = images
    family_class = model_class(config.architecture)
    num_patches = int(np.prod(grids[0]) + np.prod(grids[1]))
    pixel_values, grids = pixel_values[:num_patches], grids[:2]
    token_ids = _prompt(grids, config)
    features = [_encode(config, params, pixel_values, grids, [i])[0] for i in range(len(grids))]
    is_embed = np.asarray(token_ids) == IMAGE_TOKEN_ID
    embeds = np.zeros((len(token_ids), config.hidden_size), np.float32)
    embeds[is_embed] = np.concatenate(features)
    rope_positions, _ = family_class.mrope_positions(config, token_ids, [tuple(g) for g in grids])
    mm = _image_embeds(jnp.asarray(embeds), jnp.asarray(is_embed), jnp.asarray(rope_positions))
    run = jax.jit(
        functools.partial(
            dense_forward_logits, config=config, forward_fn=functools.partial(forward, mm=mm)
        )
    )
    ours = np.asarray(
        run(params, jnp.asarray(token_ids, jnp.int32), jnp.arange(len(token_ids), dtype=jnp.int32))
    )
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        theirs = model(
            input_ids=ids,
            pixel_values=torch.tensor(pixel_values),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
        ).logits[0]
    np.testing.assert_allclose(ours, theirs.numpy(), atol=2e-4, rtol=0)


def test_transformers_5_tensor_names_load_the_same_params(family, tmp_path):
    """transformers 5's modules name the text model "model.language_model.*" and the tower
    "model.visual.*" (save_pretrained writes transformers 4's "model.*" and "visual.*")."""
    _, _, path, config, params = family
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {
        (
            "model." + k
            if k.startswith("visual.")
            else k.replace("model.", "model.language_model.", 1)
        ): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(path / "config.json", tmp_path / "config.json")
    renamed_config, renamed_params, _ = load_model(
        str(tmp_path), dtype="float32", skip_tokenizer_init=True
    )
    assert renamed_config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(renamed_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_flat_transformers_4_config_reads_as_the_nested_one(family):
    """Qwen2-VL's released config.json: the text fields at the top level, rope_theta beside a
    rope_scaling of type "mrope"."""
    _, _, path, config, _ = family
    nested = json.loads((path / "config.json").read_text())
    text = dict(nested.pop("text_config"))
    rope = text.pop("rope_parameters")
    flat = {
        **text,
        **nested,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    assert model_config_from_hf(flat, "float32") == config
    bad = {**flat, "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]}}
    with pytest.raises(ValueError, match="mrope_section"):
        model_config_from_hf(bad, "float32")


def test_image_num_embeds_bounds_every_image_of_the_processor(family, images):
    _, _, path, config, _ = family
    _, grids = images
    family_class = model_class(config.architecture)
    counts = [family_class.image_num_embeds_for(config, g) for g in grids]
    assert counts == [35, 36, 35]
    # Without max_pixels in the config: the released checkpoints' processors' bound.
    assert family_class.image_num_embeds(config) == 12845056 // 28**2
    hf = json.loads((path / "config.json").read_text())
    bounded = model_config_from_hf({**hf, "max_pixels": MAX_PIXELS}, "float32")
    assert family_class.image_num_embeds(bounded) == 64 >= max(counts)
