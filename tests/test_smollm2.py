"""The real default model: greedy output token for token against HF transformers."""

import os

from conftest import hf_greedy

from jvllm import SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
MAX_TOKENS = 32


def test_default_model_greedy_matches_hf_transformers(smollm2_llm, hf_smollm2):
    outs = smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(PROMPTS, outs):
        expected = hf_greedy(hf_smollm2, out.prompt_token_ids, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, prompt
    assert outs[2].outputs[0].text.startswith(" Paris")


def test_default_model_tokenizes_like_hf(smollm2_llm):
    """Our torch-free GGUF tokenizer against transformers' reading of the same GGUF."""
    from transformers import AutoTokenizer

    from jvllm.model_loader.default_model import resolve_default_model

    gguf = resolve_default_model()
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    ours = smollm2_llm.get_tokenizer()
    texts = PROMPTS + [
        "The year 2050 has 12345 days!",
        "  spaces   and\ttabs\nnewlines",
        "ünïcödé 日本語 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "don't won't I'm",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf_tok.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == hf_tok.decode(
            ids, skip_special_tokens=True
        )
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        hf_tok.bos_token,
        hf_tok.eos_token,
        hf_tok.pad_token,
    )
