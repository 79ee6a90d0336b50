"""Mistral 3 (Pixtral tower, patch merger, Mistral text model): the tower and projector equal HF's
get_image_features on images of several sizes in one padded batch, greedy tokens equal HF's
through the engine with images of different sizes, and each image's tokens are the rows
PixtralProcessor writes."""

import functools

import jax
import numpy as np
import pytest
import torch
import transformers

from jvllm import LLM
from jvllm.model_loader.loader import load_model
from jvllm.models.model import encode_images
from jvllm.models.registry import model_class
from tests.vlm_models import (
    PIXTRAL_TOKENS,
    assert_greedy_equals_hf,
    hf_mistral3_greedy,
    random_image,
    save_tiny_mistral3,
)

# Images of 84 x 112, 112 x 56 and 56 x 84 pixels after the processor: 3 x 4, 4 x 2 and 2 x 3
# merged patches (HF's projector squeezes away the only row of a 1 x 1 image's).
SIZES = [(70, 100), (140, 70), (30, 60)]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory, smollm2_dir):
    path = str(tmp_path_factory.mktemp("tiny_mistral3"))
    save_tiny_mistral3(path, smollm2_dir)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    return path, model


def test_image_embeddings_equal_hf_in_one_padded_batch(mistral3):
    path, model = mistral3
    config, params, _ = load_model(path, dtype="float32", skip_tokenizer_init=True)
    family = model_class(config.architecture)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    batch, expected = [], []
    for i, (h, w) in enumerate(SIZES):
        out = processor(images=[random_image(i, h, w)], return_tensors="np", patch_size=28)
        data, grid = family.image_inputs(config, out)
        batch.append(data)
        with torch.no_grad():
            hf = model.model.get_image_features(
                torch.tensor(out["pixel_values"]), torch.tensor(out["image_sizes"])
            )
        expected.append(hf.pooler_output[0].numpy())
        assert family.image_num_embeds_for(config, grid) == len(expected[-1])
    assert len({d["patches"].shape for d in batch}) == 1  # padded to one shape
    arrays = {k: np.stack([d[k] for d in batch]) for k in batch[0]}
    ours = np.asarray(jax.jit(functools.partial(encode_images, config=config))(params, arrays))
    for got, want in zip(ours, expected):
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[: len(want)], want, rtol=1e-5, atol=1e-5 * scale)


def test_greedy_tokens_equal_hf_with_images_of_different_sizes(mistral3):
    path, model = mistral3
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=256)
    cases = [
        ("Look: [IMG] what is it?", [random_image(0, *SIZES[0])]),
        ("[IMG] then [IMG] compare", [random_image(1, *SIZES[1]), random_image(2, *SIZES[2])]),
    ]
    outputs = assert_greedy_equals_hf(
        llm, cases, 8, functools.partial(hf_mistral3_greedy, model, path)
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image, row_break, end = tokenizer.convert_tokens_to_ids(PIXTRAL_TOKENS)
    ids = outputs[0].prompt_token_ids
    first = ids.index(image)
    assert ids[first : first + 15] == ([image] * 4 + [row_break]) * 2 + [image] * 4 + [end]
