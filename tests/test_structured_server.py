"""Structured outputs and tool calling over HTTP, with the official openai client on the
default model: response_format, vLLM's structured_outputs and guided_* fields, tools with
tool_choice required / named / auto (hermes parser), streamed and whole."""

import json

import jsonschema
import openai
import pydantic
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS

from jvllm import LLM
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.chat import render_conversation
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
# A tool whose arguments no value satisfies (a required property that admits nothing).
NEVER = {
    "type": "function",
    "function": {
        "name": "never",
        "parameters": {"type": "object", "properties": {"a": False}, "required": ["a"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A hermes-style call the model is held to (tool_choice "auto" then parses it out of the text).
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties: false
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def client(smollm2_dir):
    engine = AsyncLLM(LLM(smollm2_dir, **SMOLLM2_ENGINE_KWARGS).llm_engine)
    server = ServerThread(build_app(engine, MODEL, tool_call_parser="hermes")).start()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()
    engine.shutdown()


def _chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=64, **kwargs
    )


def _streamed(client, **kwargs) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) reassembled from a stream as a client does."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function and call.function.name) or ""
                entry["arguments"] += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]


def test_response_format_json_schema_and_parse_with_pydantic(client):
    schema = Person.model_json_schema()
    reply = _chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    parsed = client.beta.chat.completions.parse(
        model=MODEL, messages=ASK, temperature=0, max_tokens=64, response_format=Person
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    json_object = client.completions.create(
        model=MODEL,
        prompt="A JSON object:",
        temperature=0,
        max_tokens=64,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(json_object.choices[0].text), dict)


def test_structured_outputs_and_guided_fields_on_completions(client):
    def complete(**extra):
        reply = client.completions.create(
            model=MODEL, prompt="Pick one:", temperature=0, max_tokens=16, extra_body=extra
        )
        return reply.choices[0]

    assert complete(structured_outputs={"choice": ["alpha", "beta"]}).text in ("alpha", "beta")
    assert complete(guided_choice=["left", "right"]).text in ("left", "right")
    regex = complete(guided_regex=r"[0-9]{3}")
    assert regex.text.isdigit() and len(regex.text) == 3 and regex.finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_grammar": "start: missing"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, None),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
        # One tool whose arguments no value satisfies: refused, not dropped from the choice.
        ({"tools": [WEATHER, NEVER], "tool_choice": "required"}, "tools"),
    ],
)
def test_invalid_constraints_and_tools_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, extra_body=body)
    if param is not None:
        assert error.value.body["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "start: "}}, "structured_outputs"),
    ],
)
def test_an_empty_grammar_is_a_400_saying_so(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, extra_body=body)
    assert error.value.body["param"] == param
    assert f"{param}: invalid structured_outputs.grammar: the grammar is empty" in str(
        error.value.body["message"]
    )


def test_tool_choice_required_and_named_give_calls_that_match_their_schemas(client):
    tools = [WEATHER, TIME]
    required = _chat(client, tools=tools, tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in _calls(choice.message):
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert _streamed(client, tools=tools, tool_choice="required")[1:] == (
        _calls(choice.message),
        "tool_calls",
    )
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = _chat(client, tools=tools, tool_choice=named).choices[0]
    [call] = _calls(reply.message)
    # A call that tool_choice forced finishes with "stop", as OpenAI's and vLLM's do.
    assert call["name"] == "get_time" and reply.finish_reason == "stop"
    jsonschema.validate(json.loads(call["arguments"]), schemas["get_time"])
    assert _streamed(client, tools=tools, tool_choice=named)[1:] == ([call], "stop")


def test_tool_choice_required_takes_tools_whose_schemas_have_defs(client):
    """pydantic's schema of nested models refers to its own $defs ("#/$defs/City"): under
    tool_choice "required" the tools sit inside one array schema, where such a $ref was a
    400 (the pointer named nothing at the new root)."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}}
    parameters = {
        "$defs": {"City": {**city, "required": ["name"]}},
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"],
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    reply = _chat(client, tools=[tool, TIME], tool_choice="required").choices[0]
    assert reply.finish_reason == "tool_calls"
    schemas = {"get_weather": parameters, "get_time": TIME["function"]["parameters"]}
    for call in _calls(reply.message):
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_tool_choice_required_takes_tools_whose_schemas_have_an_id(client):
    """A "#/$defs/..." $ref in a schema with an `$id` names a place in that schema: rebased to
    the tool's place in the array of calls it named nothing (a 400), and an allOf of such a
    $ref was closed as though the $ref named the root's $defs (unsatisfiable, a 400)."""
    name = {"type": "string", "maxLength": 12}
    parameters = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/weather.json",
        "$defs": {"City": {"type": "object", "properties": {"name": name}, "required": ["name"]}},
        "allOf": [
            {"$ref": "#/$defs/City"},
            {"properties": {"days": {"enum": [1, 2]}}, "required": ["days"]},
        ],
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    required = {"tool_choice": "required", "parallel_tool_calls": False}
    reply = _chat(client, tools=[tool], **required).choices[0]
    assert reply.finish_reason == "tool_calls"
    [call] = _calls(reply.message)
    jsonschema.validate(json.loads(call["arguments"]), parameters)


def test_tool_choice_auto_parses_hermes_calls_whole_and_streamed(client):
    body = {"structured_outputs": {"regex": HERMES_CALL}}
    reply = _chat(client, tools=[WEATHER], extra_body=body).choices[0]
    [call] = _calls(reply.message)
    assert call["name"] == "get_weather" and reply.finish_reason == "tool_calls"
    assert json.loads(call["arguments"])["unit"] == "celsius"
    assert _streamed(client, tools=[WEATHER], extra_body=body) == (
        "",
        [call],
        "tool_calls",
    )
    text = _chat(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert text.message.tool_calls is None and text.message.content


def test_tool_messages_round_trip_through_the_chat_template(smollm2_dir):
    """Assistant tool_calls (arguments as JSON text, OpenAI's form) reach the template as
    objects, tool results as role "tool", and the tools themselves."""
    template = (
        "{% for t in tools %}tool {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{% if m.tool_calls %}"
        "{% for c in m.tool_calls %}call {{ c.function.name }}({{ c.function.arguments.city }});"
        "{% endfor %}{% else %}{{ m.role }}: {{ m.content }};{% endif %}{% endfor %}"
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    conversation = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    prompt = render_conversation(tokenizer, conversation, template, tools=[WEATHER])["prompt"]
    assert prompt == (
        "tool get_weather;user: What is the weather in Paris?;call get_weather(Paris);"
        "tool: 18 degrees;"
    )
