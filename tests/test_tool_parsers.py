"""Tool call parsers: whole responses, and streams that reassemble into the same result."""

import json
import random

import pytest

from jvllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    Hermes2ProToolParser,
    Llama3JsonToolParser,
    get_tool_parser,
)

# Arguments whose text json.dumps writes differently: escapes, a surrogate pair, an escaped
# backslash before "u", numbers in other spellings, literals, nesting, empty containers.
TRICKY_ARGUMENTS = (
    r'{"s": "a\"b\\c\n\t\u00e9\ud83d\ude00\/ \\u0041 \u0001", "n": [-0, 1E2, 1.50, 0.1e-3,'
    r' 12345678901234567890], "b": [true, false, null], "o": {"e": {}, "l": []}, "x": "東京"}'
)
HERMES_TWO_CALLS = (
    "I'll look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    f'{{"name": "lookup", "arguments": {TRICKY_ARGUMENTS}}}\n</tool_call>'
)
LLAMA_TWO_CALLS = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    f'{{"name": "lookup", "parameters": {TRICKY_ARGUMENTS}}}'
)


def _canonical(arguments_text: str) -> str:
    return json.dumps(json.loads(arguments_text), ensure_ascii=False)


def _whole(parser_cls, text: str) -> tuple[str, list[tuple[str, str]]]:
    result = parser_cls().extract_tool_calls(text)
    assert result.tools_called == bool(result.tool_calls)
    for call in result.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls]
    return result.content or "", calls


def _stream(parser_cls, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Streams text cut at `cuts`, reassembled as an OpenAI client does: by tool call index."""
    parser, previous, deltas = parser_cls(), "", []
    for end in [*cuts, len(text)]:
        current = text[:end]
        deltas.append(
            parser.extract_tool_calls_streaming(previous, current, text[len(previous) : end])
        )
        previous = current
    deltas.append(parser.finish())
    content, calls = "", {}
    for delta in filter(None, deltas):
        assert delta, "an empty delta is None"
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:  # the first entry of a call names it, once
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert entry["id"].startswith("call_")
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [tuple(calls[index]) for index in range(len(calls))]


def _random_cuts(rng: random.Random, length: int) -> list[int]:
    return sorted(rng.sample(range(1, length), rng.randint(1, length // 4)))


def test_get_tool_parser_names_the_allowed_parsers():
    assert get_tool_parser("hermes") is Hermes2ProToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert set(TOOL_PARSERS) == {
        "glm45",
        "granite",
        "hermes",
        "llama3_json",
        "minimax_m2",
        "mistral",
        "openai",
        "pythonic",
        "qwen3_coder",
    }
    with pytest.raises(
        ValueError, match="glm45, granite, hermes, llama3_json, minimax_m2, mistral"
    ):
        get_tool_parser("nope")


def test_hermes_one_call_has_no_content_and_canonical_arguments():
    text = '<tool_call>\n{"name": "f", "arguments": {"a":1,"b" : [ "x" ]}}\n</tool_call>'
    result = Hermes2ProToolParser().extract_tool_calls(text)
    assert result.tools_called and result.content is None
    assert result.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1, "b": ["x"]}'}


def test_hermes_two_calls_keep_the_content_before_them():
    content, calls = _whole(Hermes2ProToolParser, HERMES_TWO_CALLS)
    # The newline between the blocks is text outside them too.
    assert content == "I'll look both up.\n\n"
    assert calls == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("lookup", _canonical(TRICKY_ARGUMENTS)),
    ]


def test_hermes_unicode_arguments_stay_unescaped():
    text = (
        '<tool_call>{"name": "weather", "arguments": {"city": "東京", "e": "\\u00e9"}}</tool_call>'
    )
    assert _whole(Hermes2ProToolParser, text) == ("", [("weather", '{"city": "東京", "e": "é"}')])


def test_hermes_tolerates_a_missing_end_tag_and_missing_arguments():
    text = 'Sure. <tool_call> {"name": "now"}  '
    assert _whole(Hermes2ProToolParser, text) == ("Sure. ", [("now", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no call.",
        "An unfinished marker <tool_ca",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # invalid JSON
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": ',  # cut off mid-call
        "Use the <tool_call> tag.",
    ],
)
def test_hermes_output_without_well_formed_calls_is_all_content(text):
    result = Hermes2ProToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.tool_calls == [] and result.content == text


def test_blank_content_is_none():
    assert Hermes2ProToolParser().extract_tool_calls(" \n").content is None
    text = '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
    assert Hermes2ProToolParser().extract_tool_calls(text).content is None


def test_llama3_calls_with_or_without_the_python_tag():
    assert _whole(Llama3JsonToolParser, ' {"name": "f", "parameters": {"q": "東京"}}') == (
        "",
        [("f", '{"q": "東京"}')],
    )
    assert _whole(Llama3JsonToolParser, '{"name": "f", "arguments": {"q": 1}}') == (
        "",
        [("f", '{"q": 1}')],
    )
    assert _whole(Llama3JsonToolParser, LLAMA_TWO_CALLS) == (
        "",
        [("get_weather", '{"city": "Paris"}'), ("lookup", _canonical(TRICKY_ARGUMENTS))],
    )


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '{"result": 42}',  # a JSON answer, not a call
        '{"name": "Ada", "age": 36}',  # a name but no parameters
        '<|python_tag|>{"name": "f", "parameters": {"a": tru}}',
        '{"name": "f", "parameters": {}} and then text',
        '{"name": "f", "parameters": {}};',
        "<|python_tag|>print('hi')",
        "<|python_ta",
    ],
)
def test_llama3_output_that_is_not_calls_is_all_content(text):
    result = Llama3JsonToolParser().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


def test_repeated_keys_are_kept_so_streamed_arguments_never_shrink():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>'
    assert _whole(Hermes2ProToolParser, text)[1] == [("f", '{"a": 1, "a": 2}')]


SHORT_TEXTS = [
    (
        Hermes2ProToolParser,
        'Hi <tool_call>{"name": "f", "arguments": {"a": "\\ud83d\\ude00\\\\u"}}',
    ),
    (Hermes2ProToolParser, '<tool_call>\n{"name": "f", "arguments": {"x": [1.5e2, -0]}}\n</tool_c'),
    (Hermes2ProToolParser, 'Hi <tool_call>\n{"name": f, "arguments": {"a": 1}}\n</tool_call>'),
    (Hermes2ProToolParser, "Text with < and <tool and <tool_call > in it <"),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "parameters": {"s": "\\"é\\u00e9"}}'),
    (
        Llama3JsonToolParser,
        '{"name": "f", "parameters": {"n": 10}} ;{"name": "g", "parameters": []}',
    ),
    (Llama3JsonToolParser, '{"parameters": {"a": "x"}, "name": "f"}'),
    (Llama3JsonToolParser, "  <|python_tag|>not json"),
]


@pytest.mark.parametrize(("parser_cls", "text"), SHORT_TEXTS)
def test_stream_cut_anywhere_reassembles_into_the_whole_response(parser_cls, text):
    whole = _whole(parser_cls, text)
    for cut in range(1, len(text)):
        assert _stream(parser_cls, text, [cut]) == whole, f"cut at {cut}"
    assert _stream(parser_cls, text, list(range(1, len(text)))) == whole


@pytest.mark.parametrize(
    ("parser_cls", "text"),
    [(Hermes2ProToolParser, HERMES_TWO_CALLS), (Llama3JsonToolParser, LLAMA_TWO_CALLS)],
)
def test_stream_in_random_chunks_reassembles_into_the_whole_response(parser_cls, text):
    whole = _whole(parser_cls, text)
    assert len(whole[1]) == 2
    rng = random.Random(0)
    for _ in range(100):
        cuts = _random_cuts(rng, len(text))
        assert _stream(parser_cls, text, cuts) == whole, f"cuts {cuts}"
    assert _stream(parser_cls, text, list(range(1, len(text)))) == whole


def test_arguments_stream_while_the_call_is_being_written():
    text = '<tool_call>{"name": "write", "arguments": {"body": "' + "word " * 20 + '"}}'
    parser = Hermes2ProToolParser()
    pieces = []
    for end in range(1, len(text) + 1):
        delta = parser.extract_tool_calls_streaming(text[: end - 1], text[:end], text[end - 1])
        if delta and "tool_calls" in delta:
            pieces.append(delta["tool_calls"][0]["function"]["arguments"])
    assert len(pieces) > 50  # a piece per character of the string, not one at the end
    assert "".join(pieces) == _whole(Hermes2ProToolParser, text)[1][0][1]


def test_a_possible_marker_is_held_back_until_finish():
    parser = Hermes2ProToolParser()
    assert parser.extract_tool_calls_streaming("", "Done <tool", "Done <tool") == {
        "content": "Done "
    }
    assert parser.finish() == {"content": "<tool"}


def test_a_call_malformed_after_its_name_went_out_streams_the_rest_as_content():
    """A stream cannot take back a sent name; the whole-response parse returns only content."""
    head = '<tool_call>{"name": "f", "arguments": {"a": 1'
    text = head + " oops}}</tool_call>"
    content, calls = _stream(Hermes2ProToolParser, text, [len(head)])
    assert calls == [("f", '{"a": ')] and content == text
    assert _whole(Hermes2ProToolParser, text) == (text, [])


def test_a_call_that_cannot_be_json_is_sent_as_content_at_once():
    text = '<tool_call>{"name": "f\nx'  # a raw newline cannot be in a JSON string
    parser = Hermes2ProToolParser()
    assert parser.extract_tool_calls_streaming("", text, text) == {"content": text}
    assert parser.finish() is None
