"""The mistral, pythonic, granite and qwen3_coder tool call parsers: whole responses, and streams
that reassemble into the same result (tool_parsers/base.py's contract)."""

import functools
import json
import random
import re
from types import SimpleNamespace

import pytest

from jvllm.entrypoints.openai.tool_calls import plan_tools, reply
from jvllm.entrypoints.openai.tool_parsers import (
    GraniteToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    get_tool_parser,
)

TRICKY_ARGUMENTS = (
    r'{"s": "a\"b\\c\n\u00e9\ud83d\ude00 \\u0041", "n": [-0, 1E2, 1.50], "b": [true, null],'
    r' "o": {"e": {}, "l": []}, "x": "東京"}'
)
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "ratio": {"type": "float"},
        "alerts": {"type": "boolean"},
        "where": {"type": "object"},
        "hours": {"type": "array"},
        "note": {"type": ["string", "null"]},  # vLLM reads str() of a list as an unknown type
        "plain": {"description": "no type: a string"},
    },
}
QWEN_TOOLS = {"get_weather": WEATHER_SCHEMA}
Qwen3Coder = functools.partial(Qwen3CoderToolParser, tools=QWEN_TOOLS)
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _canonical(arguments_text: str) -> str:
    return json.dumps(json.loads(arguments_text), ensure_ascii=False)


def _has_valid_id(parser, call_id: str) -> bool:
    if parser is MistralToolParser:
        return bool(_MISTRAL_ID.fullmatch(call_id))
    return call_id.startswith("call_") and len(call_id) == 29


def _whole(parser, text: str) -> tuple[str, list[tuple[str, str]]]:
    result = parser().extract_tool_calls(text)
    assert result.tools_called == bool(result.tool_calls)
    assert result.content is None or result.content.strip()
    for call in result.tool_calls:
        assert _has_valid_id(parser, call["id"]) and call["type"] == "function"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls]
    return result.content or "", calls


def _stream(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Streams text cut at `cuts`, reassembled as an OpenAI client does: by tool call index."""
    stream, previous, deltas = parser(), "", []
    for end in [*cuts, len(text)]:
        current = text[:end]
        deltas.append(
            stream.extract_tool_calls_streaming(previous, current, current[len(previous) :])
        )
        previous = current
    deltas.append(stream.finish())
    content, calls = "", {}
    for delta in filter(None, deltas):
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:  # the first entry of a call names it, once
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert _has_valid_id(parser, entry["id"])
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [tuple(calls[index]) for index in range(len(calls))]


def _assert_all_content(parser, text: str) -> None:
    result = parser().extract_tool_calls(text)
    assert not result.tools_called and result.tool_calls == [] and result.content == text


def test_the_new_parsers_are_registered_by_vllm_names():
    assert get_tool_parser("mistral") is MistralToolParser
    assert get_tool_parser("pythonic") is PythonicToolParser
    assert get_tool_parser("granite") is GraniteToolParser
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser


# ---- mistral


MISTRAL_LIST = (
    'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    f'{{"name": "lookup", "arguments": {TRICKY_ARGUMENTS}}}]'
)
MISTRAL_V11 = (
    'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    f"[TOOL_CALLS]look-up_2{TRICKY_ARGUMENTS}"
)


def test_mistral_list_form_keeps_the_content_before_and_gives_9_character_ids():
    assert _whole(MistralToolParser, MISTRAL_LIST) == (
        "Let me check. ",
        [("get_weather", '{"city": "Paris"}'), ("lookup", _canonical(TRICKY_ARGUMENTS))],
    )


def test_mistral_v11_form_with_and_without_the_args_token():
    assert _whole(MistralToolParser, MISTRAL_V11) == (
        "Checking.",
        [("get_weather", '{"city": "Paris"}'), ("look-up_2", _canonical(TRICKY_ARGUMENTS))],
    )


def test_mistral_text_after_the_calls_is_content():
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}]\nDone.'
    assert _whole(MistralToolParser, text) == ("\nDone.", [("f", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed. [TOOL_CALLS",
        "[TOOL_CALLS]",
        "[TOOL_CALLS] what?",
        '[TOOL_CALLS][{"name": "f"}]',  # vLLM needs "arguments"
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]',
        '[TOOL_CALLS][{"name": "f", "arguments": {}} {"name": "g", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "f", "arguments": {}}',  # cut off
        "[TOOL_CALLS]f[ARGS]",
        "[TOOL_CALLS]f[ARGS][1, 2]",
        "[TOOL_CALLS]f [ARGS]{}",
        '[TOOL_CALLS]f{"a": ',
    ],
)
def test_mistral_output_without_well_formed_calls_is_all_content(text):
    _assert_all_content(MistralToolParser, text)


# ---- pythonic


PYTHONIC_TWO_CALLS = (
    ' [get_weather(city="San Francisco", days=3, units=None, alerts=True), '
    "search(q='it\\'s \"東京\" )]', tags=['a', \"b\"], n=-1.5e3, opts={'k': [1, {'x': False}]},"
    " doc='''multi\nline ) ]'''), now()]\n"
)


def test_pythonic_calls_become_json_arguments():
    assert _whole(PythonicToolParser, PYTHONIC_TWO_CALLS) == (
        "",
        [
            (
                "get_weather",
                '{"city": "San Francisco", "days": 3, "units": null, "alerts": true}',
            ),
            (
                "search",
                json.dumps(
                    {
                        "q": 'it\'s "東京" )]',
                        "tags": ["a", "b"],
                        "n": -1500.0,
                        "opts": {"k": [1, {"x": False}]},
                        "doc": "multi\nline ) ]",
                    },
                    ensure_ascii=False,
                ),
            ),
            ("now", "{}"),
        ],
    )


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        "[citation needed]",
        "[1, 2]",
        "[]",
        "[f(1)]",  # positional arguments have no names
        "[f(x=y)]",  # a name, not a literal
        "[f(x=open('/etc/passwd'))]",
        "[f(x=1 + 2)]",
        "[f(x=(1, 2))]",
        "[f(x=b'raw')]",
        "[f(x={1: 2})]",
        "[f(**kw)]",
        "[os.system(x='ls')]",
        "[f(x=1, x=2)]",
        "[f(x=1),]",
        "[f(x=1)] and then text",
        "[f(x=1)",
        "[f(x='unclosed)]",
        "[f(x=1) g()]",
    ],
)
def test_pythonic_output_that_is_not_a_list_of_literal_calls_is_all_content(text):
    _assert_all_content(PythonicToolParser, text)


# ---- granite


GRANITE_TWO_CALLS = (
    '<|tool_call|><tool_call> [{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
    f'{{"arguments": {TRICKY_ARGUMENTS}, "name": "lookup"}}] \n'
)


def test_granite_calls_after_either_marker_or_none():
    calls = [("get_weather", '{"city": "Paris"}'), ("lookup", _canonical(TRICKY_ARGUMENTS))]
    assert _whole(GraniteToolParser, GRANITE_TWO_CALLS) == ("", calls)
    bare = '[{"name": "f", "arguments": {"a": 1}}]'
    for prefix in ("", "<|tool_call|>", "<tool_call>", " <|tool_call|> "):
        assert _whole(GraniteToolParser, prefix + bare) == ("", [("f", '{"a": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        '{"name": "f", "arguments": {}}',  # not a list
        '[{"name": "f"}]',  # vLLM needs "arguments"
        "[]",
        "[1]",
        '<tool_call><|tool_call|>[{"name": "f", "arguments": {}}]',  # markers out of order
        '[{"name": "f", "arguments": {}}] and more',
        '[{"name": "f", "arguments": {}}',
        "<|tool_call|>",
        "<|tool_ca",
    ],
)
def test_granite_output_that_is_not_a_list_of_calls_is_all_content(text):
    _assert_all_content(GraniteToolParser, text)


# ---- qwen3_coder


QWEN_TWO_CALLS = (
    "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=where>\n"
    '{"lat": 40.7, "tags": ["x"]}\n</parameter>\n</function>\n</tool_call>\n'
    "<tool_call>\n<function=write_file>\n<parameter=body>\ndef f():\n    return '<b>'\n\n"
    "</parameter>\n</function>\n</tool_call>\nDone."
)


def test_qwen3_coder_values_follow_the_schema_types():
    text = (
        "<tool_call>\n<function=get_weather>\n"
        + "".join(
            f"<parameter={name}>\n{value}\n</parameter>\n"
            for name, value in [
                ("city", "42"),
                ("days", "7"),
                ("scale", "2.0"),
                ("ratio", "0.25"),
                ("alerts", "True"),
                ("where", '{"lat": 1}'),
                ("hours", "[1, 2]"),
                ("note", "[3]"),
                ("plain", "null"),
                ("extra", "5"),
            ]
        )
        + "</function>\n</tool_call>"
    )
    _, calls = _whole(Qwen3Coder, text)
    assert calls == [
        (
            "get_weather",
            (
                '{"city": "42", "days": 7, "scale": 2, "ratio": 0.25, "alerts": true, '
                '"where": {"lat": 1}, "hours": [1, 2], "note": [3], "plain": null, "extra": "5"}'
            ),
        )
    ]


def test_qwen3_coder_values_that_do_not_convert_stay_strings():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
        "<parameter=scale>\ninf\n</parameter>\n<parameter=alerts>\nyes\n</parameter>\n"
        "<parameter=where>\n{'a': (1, 2)}\n</parameter>\n<parameter=hours>\n{1, 2}\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, calls = _whole(Qwen3Coder, text)
    assert json.loads(calls[0][1]) == {
        "days": "three",
        "scale": "inf",
        "alerts": False,
        "where": {"a": [1, 2]},  # json.loads fails, ast.literal_eval reads it (vLLM's order)
        "hours": "{1, 2}",  # a set: JSON cannot hold it
    }


def test_qwen3_coder_blocks_keep_the_content_outside_them():
    content, calls = _whole(Qwen3Coder, QWEN_TWO_CALLS)
    assert content == "I'll check.\n\n\nDone."  # the newlines between the blocks too
    assert calls == [
        ("get_weather", '{"city": "New York", "days": 3, "where": {"lat": 40.7, "tags": ["x"]}}'),
        ("write_file", json.dumps({"body": "def f():\n    return '<b>'\n"})),
    ]


def test_qwen3_coder_tolerates_missing_end_tags_and_no_parameters():
    text = "<tool_call>\n<function=now>\n</function>\n<tool_call><function=f>\n<parameter=a>x"
    text += "<parameter=b>\ny\n</parameter>\n"  # a value may end where the next parameter begins
    assert _whole(Qwen3Coder, text) == ("", [("now", "{}"), ("f", '{"a": "x", "b": "y"}')])


@pytest.mark.parametrize(
    "text",
    [
        "def f(): return 1",
        "<tool_call>\nhello\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1",  # the value is cut off
        "<tool_call>\n<function=f>\n<parameter=a 1</parameter>\n</function>",
        "<tool_call>\n<function=f>\n</function>\ntext</tool_call>",
        "<tool_call>\n<function=f",
        "<tool_call>",
    ],
)
def test_qwen3_coder_output_without_well_formed_calls_is_all_content(text):
    _assert_all_content(Qwen3Coder, text)


def test_qwen3_coder_gets_the_request_tools_through_the_tool_plan():
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
    ]
    request = SimpleNamespace(tools=tools, tool_choice="auto", parallel_tool_calls=None)
    plan = plan_tools(request, Qwen3CoderToolParser)
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    content, calls = reply(plan, text)
    assert content is None and calls[0]["function"]["arguments"] == '{"days": 3}'


# ---- streaming, every format


SHORT_TEXTS = [
    (MistralToolParser, 'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": "\\u00e9"}}] ok'),
    (MistralToolParser, 'x[TOOL_CALLS]fn[ARGS]{"a": [1]}[TOOL_CALLS]g{}'),
    (MistralToolParser, "[TOOL_CALLS]f [ARGS]{}"),
    (MistralToolParser, "Text [TOOL and [TOOL_CALLS it ["),
    (PythonicToolParser, "[f(a='x)\\'', b=[1, {'k': None}]), g()]"),
    (PythonicToolParser, '[f(s="""q"" ) """), g(x=1)] \n'),
    (PythonicToolParser, "[1, f(x=1)]"),
    (PythonicToolParser, '[f(s="""a"(b"""), g(t="")]'),  # a `"` at the end may open a """
    (
        GraniteToolParser,
        '<|tool_call|>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": 1}]',
    ),
    (GraniteToolParser, '<|tool_call|> <tool_call> [{"name": 1, "arguments": {}}]'),
    (GraniteToolParser, ' <tool_call>[{"name": "f", "arguments": {"n": -0}}]\n'),
    (Qwen3Coder, "A<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"),
    (Qwen3Coder, "<tool_call><function=f><parameter=a>\n<b></parameter></function></tool_call>!"),
    (Qwen3Coder, "<tool_call> x<function=f><parameter=a>1</parameter></function>"),
]


@pytest.mark.parametrize(("parser", "text"), SHORT_TEXTS)
def test_stream_cut_anywhere_reassembles_into_the_whole_response(parser, text):
    whole = _whole(parser, text)
    for cut in range(1, len(text)):
        assert _stream(parser, text, [cut]) == whole, f"cut at {cut}"
    assert _stream(parser, text, list(range(1, len(text)))) == whole


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (MistralToolParser, MISTRAL_LIST),
        (MistralToolParser, MISTRAL_V11),
        (PythonicToolParser, PYTHONIC_TWO_CALLS),
        (GraniteToolParser, GRANITE_TWO_CALLS),
        (Qwen3Coder, QWEN_TWO_CALLS),
    ],
)
def test_stream_in_random_chunks_reassembles_into_the_whole_response(parser, text):
    whole = _whole(parser, text)
    assert len(whole[1]) >= 2
    rng = random.Random(0)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 4)))
        assert _stream(parser, text, cuts) == whole, f"cuts {cuts}"
    assert _stream(parser, text, list(range(1, len(text)))) == whole


def test_mistral_v11_arguments_stream_while_they_are_written():
    text = '[TOOL_CALLS]write[ARGS]{"body": "' + "word " * 20 + '"}'
    stream, pieces = MistralToolParser(), []
    for end in range(1, len(text) + 1):
        delta = stream.extract_tool_calls_streaming(text[: end - 1], text[:end], text[end - 1])
        if delta and "tool_calls" in delta:
            pieces.append(delta["tool_calls"][0]["function"]["arguments"])
    assert len(pieces) > 50
    assert "".join(pieces) == '{"body": "' + "word " * 20 + '"}'


def test_qwen3_coder_sends_the_name_before_the_parameters():
    stream = Qwen3Coder()
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n1"
    delta = stream.extract_tool_calls_streaming("", text, text)
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    more = text + "2\n</parameter>\n"
    delta = stream.extract_tool_calls_streaming(text, more, more[len(text) :])
    assert delta == {"tool_calls": [{"index": 0, "function": {"arguments": '{"days": 12'}}]}


def test_a_call_malformed_after_one_went_out_streams_the_rest_as_content():
    """A stream cannot take back a sent call; the whole-response parse returns only content."""
    text = "[f(x=1), g(2)]"
    stream = _stream(PythonicToolParser, text, [len("[f(x=1), g")])
    assert stream == (", g(2)]", [("f", '{"x": 1}')])
    assert _whole(PythonicToolParser, text) == (text, [])
