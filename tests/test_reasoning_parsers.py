"""Reasoning parsers (--reasoning-parser): the split of a reply into reasoning and content, whole
and in deltas of every size; the server's end-to-end check is in test_openai_surface.py."""

import pytest

from jvllm.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    get_reasoning_parser,
    prompt_opens_thought,
    split_reply,
)

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize(
    "parser, prompt_opened, text, expected",
    [
        # The template opened the thought (R1, Qwen3-Thinking-2507): it ends at the end tag.
        (R1, True, "Let me think.</think>\n\nParis.", ("Let me think.", "\n\nParis.")),
        (QWEN3, True, "hmm</think>Paris", ("hmm", "Paris")),
        # The reply opens it itself.
        (QWEN3, False, "<think>\nhmm\n</think>\n\nParis", ("\nhmm\n", "\n\nParis")),
        (R1, False, "\n<think>hmm</think>Paris", ("hmm", "Paris")),
        # No tags: R1 always thinks, Qwen3 with thinking off answers.
        (R1, False, "no tags at all", ("no tags at all", "")),
        (QWEN3, False, "no tags at all", ("", "no tags at all")),
        # An unclosed thought is all reasoning; a tag's beginning at the end is kept.
        (QWEN3, True, "still thinking </thi", ("still thinking </thi", "")),
        (QWEN3, False, "<thi", ("", "<thi")),
        # An end tag in a reply that never opened a thought is content.
        (QWEN3, False, "a </think> b", ("", "a </think> b")),
    ],
)
def test_a_reply_splits_the_same_whole_and_in_deltas(parser, prompt_opened, text, expected):
    assert split_reply(parser, text, prompt_opened) == expected
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter(parser, prompt_opened)
        parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(splitter.finish())
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected
        # Nothing past the end tag is released as reasoning, nothing before it as content.
        assert all(parser.end not in r for r, _ in parts)


@pytest.mark.parametrize("parser", [R1, QWEN3])
def test_a_constrained_reply_thinks_only_where_it_opens_the_thought(parser):
    # The grammar holds from the first token: JSON is the content, even for R1, which always
    # thinks, and after a prompt that opened a thought.
    assert split_reply(parser, '{"a": 1}', True, constrained=True) == ("", '{"a": 1}')
    assert split_reply(parser, "<think>x</think>{}", True, constrained=True) == ("x", "{}")


def test_the_prompt_opens_a_thought_when_it_ends_with_the_start_tag():
    assert prompt_opens_thought(QWEN3, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("granite")
