"""Idefics3 / SmolVLM with images: greedy tokens equal to HF transformers' on prompts with
images split into different numbers of tiles, prefill chunks cutting through the tiles and
their marker tokens, and the SigLIP tower on a padded image (fractional positions, masked
patches)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jvllm import LLM
from jvllm.model_loader.loader import load_model
from jvllm.models.model import encode_images
from tests.vlm_models import (
    assert_greedy_equals_hf,
    hf_greedy_with_images,
    random_image,
    save_tiny_idefics3,
)


@pytest.fixture(scope="module")
def idefics3_hf(tiny_idefics3_dir):
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
        tiny_idefics3_dir, dtype=torch.float32
    )
    return model.eval(), transformers.AutoProcessor.from_pretrained(tiny_idefics3_dir)


def test_smolvlm_greedy_tokens_equal_hf(tmp_path, smollm2_dir):
    save_tiny_idefics3(str(tmp_path), smollm2_dir, smolvlm=True)
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32
    )
    processor = transformers.AutoProcessor.from_pretrained(tmp_path)  # Idefics3Processor's
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16, max_model_len=256)
    assert llm.llm_engine.model_config.architecture == "SmolVLMForConditionalGeneration"
    cases = [("Hi <image> what?", [random_image(3, 100, 60)])]
    hf = functools.partial(hf_greedy_with_images, model.eval(), processor)
    assert_greedy_equals_hf(llm, cases, 8, hf)


def test_greedy_tokens_equal_hf_with_images_of_different_tile_counts(
    tiny_idefics3_dir, idefics3_hf
):
    llm = LLM(
        tiny_idefics3_dir,
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=256,
    )
    cases = [
        ("Hello <image> what is this?", [random_image(0, 40, 50)]),  # 1 tile and the global
        ("<image> and <image> compare", [random_image(1, 112, 60), random_image(2, 100, 100)]),
    ]
    assert_greedy_equals_hf(llm, cases, 8, functools.partial(hf_greedy_with_images, *idefics3_hf))


def test_the_tower_on_a_padded_tile_equals_hf(tiny_idefics3_dir, idefics3_hf):
    model, _ = idefics3_hf
    config, params, _ = load_model(tiny_idefics3_dir, dtype="float32")
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((1, 2, 3, 56, 56)).astype(np.float32)
    mask = np.ones((1, 2, 56, 56), bool)
    mask[0, 1, 30:, :] = False  # the second tile: an image 30 pixels high, padded
    mask[0, 1, :, 45:] = False
    ours = encode_images(
        params, {"pixel_values": pixels, "pixel_attention_mask": mask}, config=config
    )
    with torch.no_grad():
        theirs = model.get_image_features(
            pixel_values=torch.tensor(pixels), pixel_attention_mask=torch.tensor(mask)
        )
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = torch.cat([t.reshape(-1) for t in theirs]) if isinstance(theirs, list) else theirs
    np.testing.assert_allclose(
        np.asarray(ours).reshape(-1), theirs.numpy().reshape(-1), atol=2e-5, rtol=1e-5
    )
    assert jnp.isfinite(ours).all()
