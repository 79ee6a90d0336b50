"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL in the engine: greedy tokens equal to HF transformers' with
images of different sizes (dynamic resolution), M-RoPE positions through chunked prefill and
decode, and Qwen3-VL's DeepStack features through chunks of an image."""

import functools

import pytest
import torch
import transformers

from jvllm import LLM
from tests.vlm_models import (
    assert_greedy_equals_hf,
    hf_qwen_greedy,
    random_image,
    save_tiny_qwen2_vl,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
HF_CLASSES = {
    "2": transformers.Qwen2VLForConditionalGeneration,
    "2.5": transformers.Qwen2_5_VLForConditionalGeneration,
    "3": transformers.Qwen3VLForConditionalGeneration,
    "3-moe": transformers.Qwen3VLMoeForConditionalGeneration,
}


@pytest.fixture(scope="module", params=list(HF_CLASSES))
def qwen(request, tmp_path_factory, smollm2_dir):
    path = str(tmp_path_factory.mktemp(f"tiny_qwen{request.param}_vl"))
    save_tiny_qwen2_vl(path, smollm2_dir, request.param)
    model = HF_CLASSES[request.param].from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def test_greedy_tokens_equal_hf_with_images_of_different_sizes(qwen):
    path, model = qwen
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512)
    cases = [
        (f"Look: {IMAGE} what is it?", [random_image(0, 140, 196)]),
        (f"{IMAGE} then {IMAGE} compare them", [random_image(1, 250, 120), random_image(2)]),
    ]
    assert_greedy_equals_hf(llm, cases, 10, functools.partial(hf_qwen_greedy, model, path))


@pytest.mark.slow  # two more engines
@pytest.mark.parametrize("setting", [{"num_scheduler_steps": 4}, {"async_scheduling": True}])
def test_m_rope_positions_advance_on_the_device_in_decode_windows_and_steps_ahead(qwen, setting):
    path, model = qwen
    llm = LLM(
        path,
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=512,
        **setting,
    )
    cases = [(f"Look: {IMAGE} what is it?", [random_image(0, 140, 196)])]
    assert_greedy_equals_hf(llm, cases, 12, functools.partial(hf_qwen_greedy, model, path))


def test_images_of_different_sizes_share_the_encoder_s_padded_shape(qwen):
    path, model = qwen
    if model.config.model_type.startswith("qwen3_vl"):
        pytest.skip("its 16 px patches give both images 128 patches: nothing to pad")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512)
    processor = llm.llm_engine.mm_processor
    shapes = set()
    for image in (random_image(0, 140, 196), random_image(1, 250, 120)):  # 140 and 144 patches
        [feature] = processor.process(
            {"prompt": IMAGE, "multi_modal_data": {"image": image}}, llm.get_tokenizer()
        ).features
        shapes.add(tuple((k, v.shape) for k, v in sorted(feature.data.items())))
        assert feature.num_embeds < feature.data["pixel_values"].shape[0] // 4  # padded
    assert len(shapes) == 1
