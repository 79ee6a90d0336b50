"""The glm45 tool call parser (GLM-4.5 / 4.6's `<arg_key>` / `<arg_value>` blocks) with the
glm45 reasoning parser, and the minimax_m2 one (`<invoke>` blocks of several calls): whole
responses, streams that reassemble into the same result (tool_parsers/base.py's contract), and
values typed as vLLM types them."""

import functools
import json

import pytest
from test_tool_parsers_more import WEATHER_SCHEMA, _assert_all_content, _whole
from test_tool_parsers_more import (
    test_stream_cut_anywhere_reassembles_into_the_whole_response as stream_cut_anywhere,
)
from test_tool_parsers_more import (
    test_stream_in_random_chunks_reassembles_into_the_whole_response as stream_in_random_chunks,
)

from jvllm.entrypoints.openai.reasoning import get_reasoning_parser
from jvllm.entrypoints.openai.tool_parsers import (
    Glm45ToolParser,
    MiniMaxM2ToolParser,
    get_tool_parser,
)

Glm45 = functools.partial(Glm45ToolParser, tools={"get_weather": WEATHER_SCHEMA})
MiniMaxM2 = functools.partial(MiniMaxM2ToolParser, tools={"get_weather": WEATHER_SCHEMA})


def _block(name: str, arguments: dict[str, str], newlines: bool = True) -> str:
    """A call as GLM-4.5's chat template writes one (GLM-4.7's: without the newlines)."""
    sep = "\n" if newlines else ""
    pairs = "".join(
        f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in arguments.items()
    )
    return f"<tool_call>{name}{sep}{pairs}</tool_call>"


TWO_CALLS = (
    "Let me look.\n"
    + _block("get_weather", {"city": "東京", "days": "3", "alerts": "true"})
    + "\n"
    + _block("lookup", {"query": '{"a": [1, 2]}', "note": "plain words"}, newlines=False)
)


def test_the_parsers_are_registered_by_vllm_names():
    assert get_tool_parser("glm45") is Glm45ToolParser
    assert get_tool_parser("minimax_m2") is MiniMaxM2ToolParser
    parser = get_reasoning_parser("glm45")
    assert (parser.start, parser.end, parser.reads_special_tokens) == ("<think>", "</think>", True)


def test_calls_in_both_layouts_keep_the_content_before_them():
    content, calls = _whole(Glm45, TWO_CALLS)
    assert content == "Let me look.\n\n"  # all text outside the blocks
    assert [name for name, _ in calls] == ["get_weather", "lookup"]
    assert json.loads(calls[0][1]) == {"city": "東京", "days": 3, "alerts": True}
    # Undeclared parameters (lookup is not among the tools): JSON where it reads, else text.
    assert json.loads(calls[1][1]) == {"query": {"a": [1, 2]}, "note": "plain words"}


def test_values_follow_vllms_rules():
    arguments = {
        "city": "42",  # a string parameter stays text
        "days": "'7'",  # not JSON, but a Python literal
        "where": '{"lat": 1.5}',
        "hours": "[1, 2]",
        "scale": "NaN",  # JSON would read NaN, which JSON cannot write: text
        "plain": "  spaced out  ",  # no type: read as JSON, else text, stripped
    }
    _, [(_, text)] = _whole(Glm45, _block("get_weather", arguments))
    assert json.loads(text) == {
        "city": "42",
        "days": "7",
        "where": {"lat": 1.5},
        "hours": [1, 2],
        "scale": "NaN",
        "plain": "spaced out",
    }


def test_a_block_without_arguments_or_its_end_tag():
    assert _whole(Glm45, "<tool_call>ping\n</tool_call>") == ("", [("ping", "{}")])
    unclosed = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
    assert _whole(Glm45, unclosed) == ("", [("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
        "<tool_call>f\n<arg_key>a</arg_key>1</tool_call>",  # no <arg_value>
        "<tool_call>f\n<arg_key>a</arg_key><arg_value>1",  # cut in a value
        "<tool_call>f\n<arg_value>1</arg_value></tool_call>",  # a value without its key
    ],
)
def test_output_without_well_formed_calls_is_all_content(text):
    _assert_all_content(Glm45, text)


# ---- minimax_m2


M2_TWO_CALLS = (
    "I will check both.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n'
    '<invoke name="lookup">\n<parameter name="tags">["a", "b"]</parameter>\n</invoke>\n'
    "</minimax:tool_call>"
)


def test_minimax_m2_blocks_hold_several_calls_typed_by_their_schemas():
    content, calls = _whole(MiniMaxM2, M2_TWO_CALLS)
    assert content == "I will check both.\n"
    assert [name for name, _ in calls] == ["get_weather", "lookup"]
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": 2}
    assert json.loads(calls[1][1]) == {"tags": '["a", "b"]'}  # undeclared: text, as vLLM's
    second = M2_TWO_CALLS + ' ok <minimax:tool_call><invoke name="ping"></invoke>'
    assert _whole(MiniMaxM2, second)[1][2] == ("ping", "{}")


@pytest.mark.parametrize(
    "text",
    [
        '<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>',  # no name
        '<minimax:tool_call><invoke name="f"><parameter name="a">1',  # cut in a value
        "<minimax:tool_call>\n<function=f></function></minimax:tool_call>",  # Qwen's markup
    ],
)
def test_minimax_m2_output_without_well_formed_calls_is_all_content(text):
    _assert_all_content(MiniMaxM2, text)


# ---- streaming, both formats


SHORT_TEXTS = [
    (
        Glm45,
        "A<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>B",
    ),
    (Glm45, "<tool_call>f<arg_key>a</arg_key><arg_value><x></arg_value></tool_call>"),
    (Glm45, "text < tool <tool_call and <arg"),
    (MiniMaxM2, '<minimax:tool_call><invoke name="f"><parameter name="a">1</parameter></invoke>'),
    (
        MiniMaxM2,
        'x<minimax:tool_call><invoke name="f"></invoke><invoke name="g"></invoke></minimax:tool_call>y',
    ),
]


@pytest.mark.parametrize(("parser", "text"), SHORT_TEXTS)
def test_stream_cut_anywhere_reassembles_into_the_whole_response(parser, text):
    stream_cut_anywhere(parser, text)


@pytest.mark.parametrize(("parser", "text"), [(Glm45, TWO_CALLS), (MiniMaxM2, M2_TWO_CALLS)])
def test_stream_in_random_chunks_reassembles_into_the_whole_response(parser, text):
    stream_in_random_chunks(parser, text)


def test_the_name_goes_out_before_the_arguments():
    stream = Glm45()
    text = "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>1"
    delta = stream.extract_tool_calls_streaming("", text, text)
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    more = text + "2</arg_value>\n"
    delta = stream.extract_tool_calls_streaming(text, more, more[len(text) :])
    assert delta == {"tool_calls": [{"index": 0, "function": {"arguments": '{"days": 12'}}]}
