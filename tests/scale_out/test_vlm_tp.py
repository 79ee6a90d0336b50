"""Models that take images over the mesh: the vision tower replicated, the text model cut at
T = 2, the step's image embeddings (and Qwen2-VL's M-RoPE positions, Qwen3-VL's DeepStack
features) whole on every device; greedy tokens equal to HF transformers'."""

import functools

import pytest
import torch
import transformers
from vlm_models import (
    assert_greedy_equals_hf,
    hf_greedy_with_images,
    hf_mistral3_greedy,
    hf_qwen_greedy,
    random_image,
    save_tiny_mistral3,
    save_tiny_qwen2_vl,
)

from jvllm import LLM

ENGINE = {"dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 4}


def test_llava_over_two_devices_equals_hf(tiny_llava_dir):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        tiny_llava_dir, dtype=torch.float32
    )
    processor = transformers.AutoProcessor.from_pretrained(tiny_llava_dir)
    llm = LLM(tiny_llava_dir, **ENGINE, max_model_len=256, tensor_parallel_size=2)
    cases = [("Hi <image> what", [random_image(0)]), ("<image><image> x", [random_image(1)] * 2)]
    hf = functools.partial(hf_greedy_with_images, model.eval(), processor)
    assert_greedy_equals_hf(llm, cases, 8, hf)


@pytest.mark.parametrize("version", ["2", "2.5", "3", "3-moe"])
def test_qwen2_vl_over_two_devices_equals_hf(tmp_path, smollm2_dir, version):
    save_tiny_qwen2_vl(str(tmp_path), smollm2_dir, version)
    hf_class = {
        "2": transformers.Qwen2VLForConditionalGeneration,
        "2.5": transformers.Qwen2_5_VLForConditionalGeneration,
        "3": transformers.Qwen3VLForConditionalGeneration,
        "3-moe": transformers.Qwen3VLMoeForConditionalGeneration,
    }[version]
    model = hf_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), **ENGINE, max_model_len=512, tensor_parallel_size=2)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    cases = [(f"Look: {image} what", [random_image(0, 140, 196)])]
    hf = functools.partial(hf_qwen_greedy, model, str(tmp_path))
    assert_greedy_equals_hf(llm, cases, 8, hf)


def test_mistral3_over_two_devices_equals_hf(tmp_path, smollm2_dir):
    """The Pixtral tower and the patch merger replicated, the Mistral text model cut."""
    save_tiny_mistral3(str(tmp_path), smollm2_dir)
    model = transformers.Mistral3ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32
    ).eval()
    llm = LLM(str(tmp_path), **ENGINE, max_model_len=256, tensor_parallel_size=2)
    cases = [("Look: [IMG] what", [random_image(0, 70, 100)])]
    hf = functools.partial(hf_mistral3_greedy, model, str(tmp_path))
    assert_greedy_equals_hf(llm, cases, 8, hf)
