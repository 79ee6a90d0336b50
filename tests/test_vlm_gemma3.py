"""Gemma 3 with images: greedy tokens and logprobs equal to HF transformers', image tokens
attending to their whole image (bidirectionally, as HF's do), images never cut across steps."""

import numpy as np
import pytest
import torch
import transformers
from test_family_gemma import TINY

from jvllm import LLM, SamplingParams
from jvllm.attention import reference
from tests.vlm_models import (
    _TINY_VISION,
    assert_greedy_equals_hf,
    hf_greedy_with_images,
    random_image,
)

MARKERS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def save_tiny_gemma3(path: str, tokenizer_dir: str) -> None:
    """A Gemma 3 of a 2-layer SigLIP (112 px, 14 px patches: 8 x 8, pooled to 4 x 4 = 16 image
    tokens) and a 2-layer Gemma 3 text model (a windowed and a global layer)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        tokenizer_dir, extra_special_tokens=MARKERS
    )
    ids = tokenizer.convert_tokens_to_ids(list(MARKERS.values()))
    text = {
        **TINY,
        "vocab_size": len(tokenizer),
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config={**_TINY_VISION, "image_size": 112, "patch_size": 14},
        mm_tokens_per_image=16,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
    )
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    torch.manual_seed(0)
    with torch.no_grad():  # O(1) activations after Gemma's sqrt(D) embedding scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)  # Gemma's norms scale by 1 + weight
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.05)
    model.save_pretrained(path)
    image_processor = transformers.Gemma3ImageProcessor(size={"height": 112, "width": 112})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=16
    )
    processor.save_pretrained(path)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_dir):
    path = str(tmp_path_factory.mktemp("tiny_gemma3"))
    save_tiny_gemma3(path, smollm2_dir)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, max_model_len=256)
    return llm, model.eval(), transformers.AutoProcessor.from_pretrained(path)


CASES = [
    ("Look: <start_of_image> what is it?", [random_image(0, 40, 50)]),
    ("<start_of_image> and <start_of_image> then", [random_image(1, 30, 60), random_image(2)]),
]


def test_greedy_tokens_equal_hf_with_one_and_two_images(gemma3):
    llm, model, processor = gemma3
    hf = lambda prompt, images, n: hf_greedy_with_images(model, processor, prompt, images, n)
    assert_greedy_equals_hf(llm, CASES, 8, hf)


def test_image_tokens_attend_to_their_whole_image_as_hf_s_do(gemma3):
    llm, model, processor = gemma3
    prompt, images = CASES[0]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    expected = torch.log_softmax(logits, -1).numpy()
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    llm.reset_prefix_cache()
    [out] = llm.generate(request, params, use_tqdm=False)
    token = out.outputs[0].token_ids[0]
    ours = out.outputs[0].logprobs[0][token].logprob
    np.testing.assert_allclose(ours, expected[token], atol=1e-4)


@pytest.mark.slow  # an engine of its own
def test_causal_attention_alone_within_images_moves_the_logprob(gemma3, monkeypatch):
    """The check above can fail: without the look-ahead term, the answer differs."""
    llm, _, _ = gemma3
    prompt, images = CASES[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    llm.reset_prefix_cache()
    [out] = llm.generate(request, params, use_tqdm=False)
    ours = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob
    ahead = reference.attend_image_ahead
    no_ahead = lambda q, k, v, groups, *args: ahead(q, k, v, groups * 0 - 1, *args)
    monkeypatch.setattr(reference, "attend_image_ahead", no_ahead)
    causal = LLM(
        llm.llm_engine.engine_config.load_config.model,
        dtype="float32",
        max_num_batched_tokens=24,
        max_num_seqs=4,
        max_model_len=256,
    )
    [out] = causal.generate(request, params, use_tqdm=False)
    causal_logprob = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob
    assert abs(causal_logprob - ours) > 1e-3


def test_a_step_never_ends_inside_an_image(gemma3):
    llm, _, _ = gemma3
    engine = llm.llm_engine
    # The image's 16 tokens start after 12: a first step of 24 tokens would end inside it.
    prompt = "one two three four five six seven eight nine ten <start_of_image> done"
    engine.add_request("whole", {"prompt": prompt, "multi_modal_data": {"image": CASES[0][1]}})
    request = engine.scheduler.get_request("whole")
    [image] = request.mm_features
    assert image.placeholder.offset < 24 < image.placeholder.end
    ends = []
    while engine.has_unfinished_requests():
        engine.step()
        ends.append(request.num_computed_tokens)
    assert ends[0] == image.placeholder.offset
    assert not any(image.placeholder.offset < end < image.placeholder.end for end in ends)
