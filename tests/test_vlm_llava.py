"""LLaVA-1.5 with images, offline: greedy tokens equal to HF transformers' on prompts with one
and several images, chunked prefill cutting through an image, the prefix cache keyed by each
image's content, the encoder cache, preemption, and prompts refused at the edge."""

import base64
import functools
import io

import pytest
import torch
import transformers

from jvllm import LLM, SamplingParams
from jvllm.entrypoints.chat import ChatImages, ContentError, image_content
from jvllm.step_loop import StepLoop
from tests.vlm_models import assert_greedy_equals_hf, hf_greedy_with_images, random_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# 16 tokens a step: each image's 16 tokens start mid-step, so prefill chunks cut through them.
ENGINE_KWARGS = {
    "dtype": "float32",
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "max_model_len": 256,
}


@pytest.fixture(scope="module")
def llava_dir(tiny_llava_dir) -> str:
    return tiny_llava_dir


@pytest.fixture(scope="module")
def llava_hf(llava_dir):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        llava_dir, dtype=torch.float32
    )
    return model.eval(), transformers.AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def llava_llm(llava_dir, media_dir) -> LLM:
    return LLM(
        llava_dir,
        **ENGINE_KWARGS,
        allowed_local_media_path=str(media_dir),
        limit_mm_per_prompt={"image": 2},
    )


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_greedy_tokens_equal_hf_with_one_and_several_images_of_different_sizes(llava_llm, llava_hf):
    model, processor = llava_hf
    cases = [
        ("Hello <image> what is this?", [random_image(0)]),
        ("<image> and <image>: which is brighter?", [random_image(1, 60, 30), random_image(2)]),
        ("Describe it. <image>", [random_image(3, 90, 120)]),
    ]
    hf = functools.partial(hf_greedy_with_images, model, processor)
    assert_greedy_equals_hf(llava_llm, cases, 8, hf)


def test_token_id_prompts_with_placeholders_or_the_processor_s_tokens_run_as_the_text(
    llava_llm, llava_hf
):
    image = random_image(4)
    text = "Tell me about <image> please"
    token_ids = llava_llm.get_tokenizer().encode(text)
    expanded = llava_hf[1](text=text, images=[image], return_tensors="np")["input_ids"][0]
    by_text, by_ids, by_expanded = llava_llm.generate(
        [
            {"prompt": text, "multi_modal_data": {"image": image}},
            {"prompt_token_ids": token_ids, "multi_modal_data": {"image": [image]}},
            {"prompt_token_ids": expanded.tolist(), "multi_modal_data": {"image": [image]}},
        ],
        GREEDY,
    )
    for output in (by_ids, by_expanded):
        assert output.prompt_token_ids == by_text.prompt_token_ids
        assert output.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_prefix_cache_reuses_an_image_s_blocks_only_for_the_same_image(llava_llm, llava_hf):
    model, processor = llava_hf
    # 40 text tokens, then the image (16 tokens) in blocks 2 and 3, then 20 more.
    prompt = " ".join(["tiles"] * 40) + " <image>" + " more" * 20
    first, second = random_image(5), random_image(6)
    encoder = llava_llm.llm_engine.model_runner.encoder
    a = llava_llm.generate({"prompt": prompt, "multi_modal_data": {"image": first}}, GREEDY)[0]
    num_encoded = encoder.num_images_encoded
    same = llava_llm.generate({"prompt": prompt, "multi_modal_data": {"image": first}}, GREEDY)[0]
    other = llava_llm.generate({"prompt": prompt, "multi_modal_data": {"image": second}}, GREEDY)[0]
    image_start = a.prompt_token_ids.index(processor.tokenizer.convert_tokens_to_ids("<image>"))
    assert same.num_cached_tokens > image_start + 16  # past the image
    assert other.num_cached_tokens <= image_start  # only the blocks before the image
    assert encoder.num_images_encoded == num_encoded + 1  # the repeat came from the cache
    assert same.outputs[0].token_ids == a.outputs[0].token_ids
    _, expected = hf_greedy_with_images(model, processor, prompt, [second], 8)
    assert list(other.outputs[0].token_ids) == expected
    assert other.outputs[0].token_ids != a.outputs[0].token_ids


def test_preempted_requests_with_images_resume_with_hf_s_tokens(llava_dir, llava_hf):
    # 6 blocks of 16 tokens for three requests of 3 blocks each: some are preempted.
    llm = LLM(llava_dir, **ENGINE_KWARGS, num_gpu_blocks_override=7, enable_prefix_caching=False)
    cases = [(f"Picture {i}: <image> tell", [random_image(10 + i)]) for i in range(3)]
    assert_greedy_equals_hf(llm, cases, 24, functools.partial(hf_greedy_with_images, *llava_hf))
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ({"prompt": "no placeholder", "multi_modal_data": {"image": "x"}}, TypeError, "PIL"),
        ({"prompt": "none here", "multi_modal_data": {"image": None}}, None, None),
        ({"prompt": "two <image> <image>", "multi_modal_data": {}}, None, None),
        (
            {"prompt": "no placeholder", "multi_modal_data": {"image": "IMG"}},
            ValueError,
            "0 image placeholders",
        ),
        ({"prompt": "a <image>", "multi_modal_data": {"video": ["v"]}}, ValueError, "video"),
    ],
)
def test_bad_image_prompts_are_refused_and_nothing_enters_the_engine(
    llava_llm, prompt, error, match
):
    if prompt["multi_modal_data"].get("image") == "IMG":
        prompt = {**prompt, "multi_modal_data": {"image": random_image(20)}}
    engine = llava_llm.llm_engine
    if error is None:  # no images: a text prompt, placeholders and all
        engine.add_request("ok", prompt, GREEDY)
        engine.abort_request("ok")
    else:
        with pytest.raises(error, match=match):
            engine.add_request("bad", prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_more_images_than_limit_mm_per_prompt_is_refused(llava_llm):
    images = [random_image(0), random_image(1), random_image(2)]  # the engine's limit: 2
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llava_llm.generate({"prompt": "<image>" * 3, "multi_modal_data": {"image": images}})
    assert not llava_llm.llm_engine.has_unfinished_requests()


def test_a_text_only_model_refuses_images(smollm2_llm):
    with pytest.raises(ValueError, match="takes no images.*LlavaForConditionalGeneration"):
        smollm2_llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0)}})


def test_chat_with_image_parts_equals_hf_s_template_processor_and_generate(
    llava_llm, llava_hf, media_dir
):
    model, processor = llava_hf
    first, second = random_image(30), random_image(31, 33, 77)
    second.save(media_dir / "second.png")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": data_url(first)}},
                {"type": "text", "text": "with"},
                {"type": "image_url", "image_url": {"url": f"file://{media_dir}/second.png"}},
            ],
        }
    ]
    [out] = llava_llm.chat(messages, GREEDY, use_tqdm=False)
    hf_messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "with"},
                {"type": "image"},
            ],
        }
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    # The PNG round trip is lossless: HF reads the same pixels.
    prompt_ids, expected = hf_greedy_with_images(model, processor, text, [first, second], 8)
    assert out.prompt_token_ids[-len(prompt_ids) + 1 :] == prompt_ids[1:]  # BOS as the template
    assert list(out.outputs[0].token_ids) == expected
    [pil] = llava_llm.chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": first}]}],
        GREEDY,
        use_tqdm=False,
    )
    assert pil.outputs[0].token_ids


def test_chat_refuses_a_file_outside_the_allowed_folder_and_audio_parts(llava_llm, tmp_path):
    random_image(0).save(tmp_path / "outside.png")
    escape = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/outside.png"}}
    with pytest.raises(ValueError, match="allowed_local_media_path|outside"):
        llava_llm.chat([{"role": "user", "content": [escape]}], GREEDY, use_tqdm=False)
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    with pytest.raises(ValueError, match="audio are not supported"):
        llava_llm.chat([{"role": "user", "content": [audio]}], GREEDY, use_tqdm=False)


def test_a_text_part_beside_an_image_without_its_text_is_refused_naming_the_field():
    images = ChatImages("<image>", load=lambda url: random_image(0))
    content = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, {"type": "text"}]
    with pytest.raises(ContentError, match=r"messages\[0\]\.content\[1\]\.text is missing"):
        image_content([{"role": "user", "content": content}], images)


def test_the_step_loop_refuses_images(llava_llm):
    prompt = {"prompt": "a <image>", "multi_modal_data": {"image": random_image(0)}}
    with pytest.raises(ValueError, match="step loop takes text prompts only"):
        StepLoop(llava_llm).prefill([prompt])
    assert not llava_llm.llm_engine.has_unfinished_requests()


def test_a_chat_template_of_strings_gets_each_image_s_placeholder_before_the_text(llava_llm):
    template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}\n{% endfor %}"
    content = [
        {"type": "image_pil", "image_pil": random_image(7)},
        {"type": "text", "text": "What is it?"},
    ]
    [out] = llava_llm.chat(
        [{"role": "user", "content": content}], GREEDY, chat_template=template, use_tqdm=False
    )
    assert out.prompt.startswith("user: <image>\nWhat is it?")
    assert out.outputs[0].token_ids


def test_a_failed_step_forgets_the_images_it_was_to_encode(llava_llm, monkeypatch):
    engine = llava_llm.llm_engine
    image = random_image(50)
    request = {"prompt": "Fail on <image> now", "multi_modal_data": {"image": image}}

    def fail(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine.model_runner, "execute_model", fail)
    engine.add_request("doomed", request, GREEDY)
    [failed] = engine.step()
    assert failed.outputs[0].finish_reason == "abort"
    monkeypatch.undo()
    [again] = llava_llm.generate(request, GREEDY, use_tqdm=False)  # encodes it anew
    assert again.outputs[0].token_ids


def test_too_many_image_parts_are_refused_before_any_is_fetched(llava_llm):
    unreachable = {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}
    messages = [{"role": "user", "content": [unreachable] * 3}]  # the engine's limit: 2
    with pytest.raises(ValueError, match="3 images, more than limit_mm_per_prompt"):
        llava_llm.chat(messages, GREEDY, use_tqdm=False)


def test_a_text_only_model_takes_an_empty_image_list_as_text(smollm2_llm):
    [out] = smollm2_llm.generate(
        {"prompt": "hi", "multi_modal_data": {"image": []}},
        SamplingParams(temperature=0.0, max_tokens=2),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 2
