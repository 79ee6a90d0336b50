"""Incremental detokenization against the tokenizer's own decode, on the default model's
byte-level BPE tokenizer, where an emoji or a CJK character spans tokens: the output's text is
the decoded prompt and output with the prompt's text (less an incomplete last character) cut
off, however the ids are split between prompt and output."""

import pytest
from transformers import AutoTokenizer

from jvllm import LLM, SamplingParams
from jvllm.engine.detokenizer import IncrementalDetokenizer

TEXT = "Hi 😀 and 日本語, 👩‍👩‍👧 ok"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _expected(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """The output's text: the prompt's end inside a character (U+FFFD) belongs to it."""
    prompt_text = tokenizer.decode(prompt_ids).rstrip("\ufffd")
    return tokenizer.decode(prompt_ids + output_ids)[len(prompt_text) :]


def test_a_prompt_ending_inside_a_character_leaves_the_character_to_the_output(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cuts_inside = [c for c in range(1, len(ids)) if tokenizer.decode(ids[:c]).endswith("\ufffd")]
    assert len(cuts_inside) >= 4  # the text does split characters across tokens
    for cut in range(1, len(ids)):
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut])
        text = "".join(detokenizer.add_token(token) for token in ids[cut:])
        assert text == detokenizer.text == _expected(tokenizer, ids[:cut], ids[cut:]), cut


def test_a_prompt_character_left_incomplete_is_output_as_decode_shows_it(tokenizer):
    # An output that does not complete the prompt's last character: decode's U+FFFD, then it.
    ids = tokenizer.encode("Hi 😀", add_special_tokens=False)
    prompt_ids = ids[:-1]
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    output_ids = tokenizer.encode(" ok", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    text = "".join(detokenizer.add_token(token) for token in output_ids)
    assert text == _expected(tokenizer, prompt_ids, output_ids) == "\ufffd ok"


def test_the_engine_completes_a_character_the_prompt_began(tiny_llama_dir, tokenizer):
    prompt_ids = tokenizer.encode("Hi", add_special_tokens=False)
    emoji = tokenizer.encode("😀", add_special_tokens=False)  # three tokens
    prompt_ids, last = prompt_ids + emoji[:-1], emoji[-1]
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_seqs=8, max_model_len=256)
    # The only allowed token completes the emoji the prompt began.
    params = SamplingParams(max_tokens=1, allowed_token_ids=[last], ignore_eos=True)
    output = llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0]
    assert list(output.token_ids) == [last] and output.text == "😀"
