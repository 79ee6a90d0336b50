"""gpt-oss's harmony replies through the "openai_gptoss" reasoning parser and the "openai" tool
call parser: whole, and streamed cut at every point, the stream reassembling into the whole
reply's reasoning, content and calls; the tool parser alone on the raw reply gives the same."""

import itertools
from types import SimpleNamespace

import pytest

from jvllm.entrypoints.openai.harmony import Header, parse_header
from jvllm.entrypoints.openai.protocol import ChatCompletionRequest
from jvllm.entrypoints.openai.reasoning import REASONING_PARSERS, split_reply
from jvllm.entrypoints.openai.serving_engine import OpenAIServing
from jvllm.entrypoints.openai.tool_parsers import OpenAIToolParser, get_tool_parser

GPT_OSS = REASONING_PARSERS["openai_gptoss"]
WEATHER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"

# (reply as the model writes it after the prompt's <|start|>assistant, its reasoning, its
# content, its calls as (name, arguments)).
REPLIES = {
    "analysis then final": (
        (
            "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
        ),
        "User asks 2+2. Simple.",
        "2 + 2 = 4.",
        [],
    ),
    "analysis then a call": (
        (
            "<|channel|>analysis<|message|>Need the weather.<|end|>"
            f'{WEATHER}<|message|>{{"city":"Paris",  "days": [1, 2.50]}}'
        ),
        "Need the weather.",
        "",
        [("get_weather", '{"city": "Paris", "days": [1, 2.5]}')],
    ),
    # A preamble, then two calls: the second names its recipient before its channel and
    # writes `json` without <|constrain|>; its arguments stay unescaped.
    "two calls": (
        (
            "<|channel|>analysis<|message|>Two lookups.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
            f'{WEATHER}<|message|>{{"city": "Paris"}}<|call|>'
            "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>"
            '{"q": "東京\\u00e9", "n": -0}'
        ),
        "Two lookups.",
        "Checking both.",
        [("get_weather", '{"city": "Paris"}'), ("lookup", '{"q": "東京é", "n": 0}')],
    ),
    # Messages on each side join with newlines; a message to a built-in tool is dropped.
    "several messages": (
        (
            "<|channel|>analysis<|message|>First.<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
            "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json"
            '<|message|>{"query": "x"}<|call|>'
            "<|start|>assistant<|channel|>commentary<|message|>Plan.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
        ),
        "First.\nSecond.",
        "Plan.\nDone.",
        [],
    ),
    "cut off mid-header": (
        "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>fin",
        "Let me think.",
        "",
        [],
    ),
    "cut off in the first header": ("<|channel|>analy", "", "", []),
    "first message is the call": (
        " to=functions.now<|channel|>commentary <|constrain|>json<|message|>{ }<|call|>",
        "",
        "",
        [("now", "{}")],
    ),
}


def _tool_parse(text: str) -> tuple[str, list[tuple[str, str]]]:
    result = OpenAIToolParser().extract_tool_calls(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls]
    assert result.tools_called == bool(calls)
    return result.content or "", calls


def _whole(text: str) -> tuple[str, str, list]:
    reasoning, content = split_reply(GPT_OSS, text, prompt_opened=False)
    return reasoning, *_tool_parse(content)


def _stream(text: str, cuts: list[int]) -> tuple[str, str, list]:
    """The reply streamed in pieces cut at `cuts`, through both parsers as the chat route
    chains them, reassembled as an OpenAI client does."""
    splitter, parser = GPT_OSS.splitter(prompt_opened=False), OpenAIToolParser()
    reasoning, parsed, deltas = "", "", []
    bounds = [0, *cuts, len(text)]
    for start, end in itertools.pairwise(bounds):
        more_reasoning, more_content = splitter.feed_delta(text[start:end], end == len(text))
        assert "<|" not in more_reasoning
        reasoning += more_reasoning
        deltas.append(parser.extract_tool_calls_streaming(parsed, parsed + more_content, ""))
        parsed += more_content
    deltas.append(parser.finish())
    content, calls = "", {}
    for delta in filter(None, deltas):
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] == len(calls)
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    assert "<|" not in content
    return reasoning, content, [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("name", REPLIES)
def test_a_reply_splits_into_reasoning_content_and_calls(name):
    text, *expected = REPLIES[name]
    assert _whole(text) == tuple(expected)
    # The tool parser alone, on the raw reply, drops the reasoning and gives the same.
    assert _tool_parse(text) == tuple(expected[1:])


@pytest.mark.parametrize("name", REPLIES)
def test_a_reply_streamed_cut_anywhere_reassembles_into_the_whole(name):
    text = REPLIES[name][0]
    whole = _whole(text)
    for cut in range(1, len(text)):
        assert _stream(text, [cut]) == whole, f"cut at {cut}"
    assert _stream(text, list(range(1, len(text)))) == whole


def test_markers_and_headers_are_held_back_until_certain():
    splitter = GPT_OSS.splitter(prompt_opened=False)
    assert splitter.feed("<|channel|>analysis<|mess") == ("", "")
    assert splitter.feed("age|>Hmm <|e") == ("Hmm ", "")
    assert splitter.feed("nd|><|start|>assistant<|channel|>final") == ("", "")
    assert splitter.feed("<|message|>Hi") == ("", "Hi")
    parser = OpenAIToolParser()
    head = f"Sure.{WEATHER}"
    assert parser.extract_tool_calls_streaming("", head, head) == {"content": "Sure."}
    text = head + '<|message|>{"city": "Pa'
    delta = parser.extract_tool_calls_streaming(head, text, text[len(head) :])
    call = delta["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("<|channel|>final", Header("final", None, None)),
        ("<|start|>assistant<|channel|>analysis", Header("analysis", None, None)),
        (
            "<|channel|>commentary to=functions.f <|constrain|>json",
            Header("commentary", "functions.f", "<|constrain|>json"),
        ),
        (
            "<|channel|>commentary to=functions.f<|constrain|>json",
            Header("commentary", "functions.f", "<|constrain|>json"),
        ),
        (
            "<|start|>assistant to=functions.f<|channel|>commentary json",
            Header("commentary", "functions.f", "json"),
        ),
        ("<|channel|>commentary functions.f", Header("commentary", "functions.f", None)),
    ],
)
def test_headers_read_as_harmony_reads_them(header, expected):
    assert parse_header(header) == expected


def test_a_call_whose_body_is_not_a_json_object_makes_the_reply_content():
    for body in ('{"city": "Paris",}', "", '{"city": "Pa', '{"a": 1} and more'):
        text = f"{WEATHER}<|message|>{body}<|call|>"
        assert _tool_parse(text) == (text, [])


def test_a_body_of_another_content_type_is_the_arguments_as_written():
    text = "<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)\n"
    assert _tool_parse(text) == ("", [("run", "print(1)\n")])


def test_a_constrained_reply_or_an_opened_analysis_starts_outside_a_header():
    assert split_reply(GPT_OSS, '{"a": 1}', False, constrained=True) == ("", '{"a": 1}')
    text = "Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    assert split_reply(GPT_OSS, text, True) == ("Hmm.", "Hi")
    assert not split_reply(GPT_OSS, '{"a": 1}', False)[1]  # the reply would be a header


def test_harmonys_parsers_keep_special_tokens_in_the_replies():
    assert get_tool_parser("openai") is OpenAIToolParser
    assert OpenAIToolParser.reads_special_tokens and GPT_OSS.reads_special_tokens
    assert not REASONING_PARSERS["qwen3"].reads_special_tokens
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    for reads in (False, True):
        serving = SimpleNamespace(reads_special_tokens=reads, defaults={}, max_logprobs=5)
        params = OpenAIServing.sampling_params(serving, request, max_tokens=4, logprobs=None)
        assert params.skip_special_tokens is not reads
