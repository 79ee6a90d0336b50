"""LLaVA-NeXT with images: greedy tokens equal to HF transformers' on prompts with images of
different aspect ratios (different grids of tiles, unpadded differently), the encoder's packed
features equal to HF's, the host's layout of each image's features equal to HF's
pack_image_features for many sizes, and the checkpoint layouts of transformers 4 and 5."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jvllm import LLM
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.model_loader.loader import load_model
from jvllm.models.llava_next import LlavaNextForConditionalGeneration, feature_rows
from jvllm.models.model import encode_images
from tests.vlm_models import (
    assert_greedy_equals_hf,
    hf_greedy_with_images,
    random_image,
    save_tiny_llava_next,
)

# (height, width) in pixels; the tiny model's grids are 1 x 2, 2 x 1 and 2 x 2 tiles of 28 px.
SIZES = [(5, 17), (17, 5), (20, 90), (28, 28), (33, 77), (40, 50), (41, 41), (60, 30), (99, 56)]


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory, smollm2_dir) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llava_next"))
    save_tiny_llava_next(path, smollm2_dir)
    return path


@pytest.fixture(scope="module")
def llava_next_hf(llava_next_dir):
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        llava_next_dir, dtype=torch.float32
    )
    return model.eval(), transformers.AutoProcessor.from_pretrained(llava_next_dir)


@pytest.fixture(scope="module")
def loaded(llava_next_dir):
    config, params, _ = load_model(llava_next_dir, dtype="float32", skip_tokenizer_init=True)
    return config, params


def test_greedy_tokens_equal_hf_with_one_and_two_images_of_different_aspect_ratios(
    llava_next_dir, llava_next_hf
):
    # 16 tokens a step: every image's 34 to 70 tokens take several prefill chunks.
    llm = LLM(
        llava_next_dir,
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=256,
    )
    cases = [
        ("Hello <image> what is this?", [random_image(0, 40, 50)]),  # 2 x 2 tiles, cut rows
        # 2 x 1 tiles, cut columns; 1 x 2 tiles, cut rows
        ("<image> and <image>: which?", [random_image(1, 60, 30), random_image(2, 20, 90)]),
        ("Describe <image>", [random_image(3, 28, 28)]),  # nothing cut
    ]
    hf = functools.partial(hf_greedy_with_images, *llava_next_hf)
    outputs = assert_greedy_equals_hf(llm, cases, 8, hf)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == len(cases)


@pytest.mark.slow  # the greedy parity test covers it end to end
def test_encode_images_equals_hf_packed_image_features(llava_next_hf, loaded):
    model, processor = llava_next_hf
    config, params = loaded
    family = LlavaNextForConditionalGeneration
    encode = jax.jit(functools.partial(encode_images, config=config))
    images = [random_image(4, 40, 50), random_image(5, 40, 50), random_image(6, 20, 90)]
    per_image = []
    for image in images:
        out = processor.image_processor(images=[image], return_tensors="np")
        per_image.append(family.image_inputs(config, dict(out))[0])
        with torch.no_grad():
            expected = model.model.get_image_features(
                pixel_values=torch.tensor(out["pixel_values"]),
                image_sizes=torch.tensor(out["image_sizes"]),
            ).pooler_output[0]
        ours = encode(params, {k: v[None] for k, v in per_image[-1].items()})
        np.testing.assert_allclose(np.asarray(ours)[0], expected.numpy(), atol=2e-5, rtol=1e-5)
    # The two images of one size encode as one batch, each as it does alone.
    batch = {k: np.stack([d[k] for d in per_image[:2]]) for k in per_image[0]}
    both = np.asarray(encode(params, batch))
    for i in range(2):
        alone = encode(params, {k: v[None] for k, v in per_image[i].items()})
        np.testing.assert_allclose(both[i], np.asarray(alone)[0], atol=1e-5, rtol=1e-5)


def test_feature_rows_lay_features_out_as_hf_s_pack_and_count_as_its_processor(
    llava_next_hf, loaded
):
    model, processor = llava_next_hf
    config, _ = loaded
    image_token_id = config.option("image_token_id")
    tile_features = config.option("vision").num_patches
    for height, width in SIZES:
        out = processor(text=["<image>"], images=[random_image(7, height, width)])
        num_tiles = len(out["pixel_values"][0])
        # Each feature's value is its row: HF's packing then shows where each one goes.
        features = torch.arange(num_tiles * tile_features, dtype=torch.float64)
        features = features.reshape(num_tiles, tile_features, 1)
        newline = torch.tensor([float(num_tiles * tile_features)], dtype=torch.float64)
        [packed], _ = model.model.pack_image_features(
            [features], torch.tensor([[height, width]]), "default", image_newline=newline
        )
        rows = feature_rows(config, height, width)
        np.testing.assert_array_equal(rows, packed[:, 0].numpy().astype(np.int32))
        assert len(rows) == out["input_ids"][0].count(image_token_id), (height, width)
        assert len(rows) <= LlavaNextForConditionalGeneration.image_num_embeds(config)


def test_image_num_embeds_is_the_largest_image_s(loaded):
    config, _ = loaded
    # The 2 x 2 grid unpadded to nothing: 8 rows of 8 features and a newline, and the base's 16.
    assert LlavaNextForConditionalGeneration.image_num_embeds(config) == 8 * 9 + 16
    assert len(feature_rows(config, 56, 56)) == 8 * 9 + 16


@pytest.mark.parametrize("layout", ["transformers_5", "released"])
def test_other_checkpoint_layouts_load_the_same_params(
    layout, llava_next_dir, llava_next_hf, loaded, tmp_path
):
    """transformers 5's own module names ("model.language_model.*", "model.vision_tower.*",
    "model.image_newline", "lm_head.weight"), and the released checkpoints' transformers 4 names
    with the tower under "vision_tower.vision_model.*"."""
    model, _ = llava_next_hf
    config, params = loaded
    if layout == "transformers_5":
        tensors = {k: v.numpy() for k, v in model.state_dict().items()}
    else:
        tensors = {
            k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
            for k, v in load_file(f"{llava_next_dir}/model.safetensors").items()
        }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{llava_next_dir}/config.json", tmp_path / "config.json")
    other_config, other_params, _ = load_model(
        str(tmp_path), dtype="float32", skip_tokenizer_init=True
    )
    assert other_config == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(other_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy='full'"),
        ({"vision_aspect_ratio": "anyres_max_9"}, "vision_aspect_ratio='anyres_max_9'"),
        ({"image_grid_pinpoints": [[28, 50]]}, "image_grid_pinpoints.*multiple"),
        ({"image_grid_pinpoints": [28, 56]}, "image_grid_pinpoints"),
    ],
)
def test_settings_it_does_not_implement_are_refused_naming_the_field(llava_next_dir, change, match):
    with open(f"{llava_next_dir}/config.json") as f:
        hf_config = json.load(f)
    with pytest.raises(ValueError, match=match):
        model_config_from_hf({**hf_config, **change}, "float32")
