"""POST /v1/responses (OpenAI's Responses API) on the default model, through the official
client: the same reply as the chat completion of the same messages, whole and streamed, with
`text.format` constraints, reasoning items under --reasoning-parser, and refusals of what it
does not serve."""

import json

import httpx
import openai
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS

from jvllm import LLM
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "smol"
QUESTION = "What is the capital of France?"
THINKING = r"<think>[a-z ]{2,12}</think> ?[A-Z][a-z]{1,9}"


@pytest.fixture(scope="module")
def servers(smollm2_dir):
    engine = AsyncLLM(LLM(smollm2_dir, **SMOLLM2_ENGINE_KWARGS).llm_engine)
    threads = [
        ServerThread(build_app(engine, MODEL)).start(),
        ServerThread(build_app(engine, MODEL, reasoning_parser="deepseek_r1")).start(),
        ServerThread(build_app(engine, MODEL, tool_call_parser="hermes")).start(),
    ]
    yield {"plain": threads[0].url, "reasoning": threads[1].url, "tools": threads[2].url}
    for thread in threads:
        thread.stop()
    engine.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat(url: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_response_is_the_chat_reply_to_the_same_messages(servers):
    client = _client(servers["plain"])
    # 4 tokens: the reply is cut at max_output_tokens.
    response = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0
    )
    chat = _chat(servers["plain"], [{"role": "user", "content": QUESTION}], 4)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.status == "incomplete" and response.incomplete_details.reason == (
        "max_output_tokens"
    )
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    # instructions and message items (text parts, a developer role) render as chat messages.
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input=items, max_output_tokens=8, temperature=0
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
    ]
    chat = _chat(servers["plain"], messages, 8)
    assert response.output_text == chat["choices"][0]["message"]["content"]


def test_a_streamed_response_sends_the_apis_events_in_order(servers):
    client = _client(servers["plain"])
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens == 4


def test_text_format_constrains_the_response(servers):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    args = {
        "model": MODEL,
        "input": QUESTION + " Reply in JSON.",
        "max_output_tokens": 40,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    }
    response = _client(servers["plain"]).responses.create(**args)
    assert set(json.loads(response.output_text)) == {"city"}
    # deepseek_r1's replies think by default, but not a constrained one: the JSON is the text.
    thinking = _client(servers["reasoning"]).responses.create(**args)
    assert [item.type for item in thinking.output] == ["message"]
    assert thinking.output_text == response.output_text


def test_reasoning_is_an_output_item_of_its_own(servers):
    client = _client(servers["reasoning"])
    # The constraint makes SmolLM2 think first, as a thinking model would.
    extra = {"guided_regex": THINKING}
    args = {"model": MODEL, "input": QUESTION, "max_output_tokens": 40, "temperature": 0}
    plain = _client(servers["plain"]).responses.create(**args, extra_body=extra).output_text
    thought, answer = plain[len("<think>") :].split("</think>")
    response = client.responses.create(**args, extra_body=extra)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == thought
    assert message.type == "message"
    assert response.output_text == answer
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(**args, extra_body=extra, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": QUESTION, "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": QUESTION, "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
        ({"input": ""}, "input"),
        ({"input": QUESTION, "n": 2}, "n"),
        ({"input": QUESTION, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"input": QUESTION, "top_logprobs": 21}, "top_logprobs"),
        ({"input": QUESTION, "top_logprobs": -1}, "top_logprobs"),
        ({"input": QUESTION, "include": ["reasoning.encrypted_content"]}, "include"),
    ],
)
def test_what_responses_do_not_serve_is_a_400_naming_it(servers, body, param):
    response = httpx.post(
        servers["plain"] + "/v1/responses", json={"model": MODEL, **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_forced_tool_call_is_a_function_call_item_whole_or_streamed(servers):
    client = _client(servers["plain"])
    args = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "max_output_tokens": 40}
    named = {"type": "function", "name": "get_weather"}
    for choice in ("required", named):
        response = client.responses.create(**args, tool_choice=choice, temperature=0)
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    events = list(client.responses.create(**args, tool_choice=named, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments
    assert events[-1].response.usage.output_tokens == response.usage.output_tokens


def test_function_call_items_render_as_the_chat_apis_tool_messages(servers):
    arguments = json.dumps({"city": "Paris"})
    # The turn's text and its call are one assistant message, as the chat API writes it.
    items = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me check."},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": arguments,
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    response = _client(servers["plain"]).responses.create(
        model=MODEL,
        input=items,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    chat = _chat(servers["plain"], messages, 8, tools=chat_tools, tool_choice="none")
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_auto_tool_choice_reads_the_calls_out_of_the_reply(servers):
    # The constraint makes SmolLM2 write a call the way Qwen's template asks (hermes).
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    args = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "max_output_tokens": 40}
    extra = {"guided_regex": call}
    response = _client(servers["tools"]).responses.create(**args, temperature=0, extra_body=extra)
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert set(json.loads(item.arguments)) == {"city"}
    events = _client(servers["tools"]).responses.create(
        **args, temperature=0, extra_body=extra, stream=True
    )
    assert [i.type for i in list(events)[-1].response.output] == ["function_call"]


def test_tool_choice_auto_without_tools_is_the_apis_default(servers):
    response = _client(servers["plain"]).responses.create(
        model=MODEL, input=QUESTION, tool_choice="auto", max_output_tokens=4, temperature=0
    )
    assert response.tool_choice == "auto" and response.output[0].type == "message"


# A hermes call of get_weather, for guided_regex.
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'


def _collapsed(kinds) -> list[str]:
    """Event types with each run of one type as one."""
    collapsed = []
    for kind in kinds:
        if not collapsed or collapsed[-1] != kind:
            collapsed.append(kind)
    return collapsed


def test_auto_tool_calls_stream_as_function_call_items_as_they_are_parsed(servers):
    # Text, then two calls: the constraint makes SmolLM2 write them as hermes reads them.
    extra = {"guided_regex": r"Let me check\.\n" + CALL + r"\n" + CALL}
    args = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "max_output_tokens": 80}
    client = _client(servers["tools"])
    whole = client.responses.create(**args, temperature=0, extra_body=extra)
    assert [i.type for i in whole.output] == ["message", "function_call", "function_call"]
    events = list(client.responses.create(**args, temperature=0, extra_body=extra, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Each call is added, streamed and done before the next; the message, whose text goes on
    # between the calls, is done at the end.
    kinds = [(e.type, e.output_index) for e in events[2:-1]]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    for index in (1, 2):
        at = [i for i, (_, k) in enumerate(kinds) if k == index]
        assert at == list(range(at[0], at[-1] + 1))  # one run of events
        assert _collapsed(kinds[i][0] for i in at) == call_events
    assert _collapsed(kind for kind, index in kinds if index == 0) == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[0] == ("response.output_item.added", 0) and kinds[-1][1] == 0
    # The arguments stream as the parser reads them, not in one piece at the end.
    assert sum(kind == call_events[1] for kind, _ in kinds) > 2
    for index, item in enumerate(final.output):
        at = [e for e in events if getattr(e, "output_index", None) == index]
        assert {e.item.id if hasattr(e, "item") else e.item_id for e in at} == {item.id}
        added = next(e for e in at if e.type == call_events[0])
        assert added.item.id == item.id
        if item.type == "function_call":
            assert added.item.call_id == item.call_id and item.call_id.startswith("call_")
            deltas = [e.delta for e in at if e.type == call_events[1]]
            assert "".join(deltas) == item.arguments == whole.output[index].arguments
            assert item.name == whole.output[index].name == "get_weather"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text == "Let me check.\n\n"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_output_text_logprobs_are_the_chat_apis_whole_and_streamed(servers):
    client = _client(servers["plain"])
    args = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "temperature": 0}
    include = ["message.output_text.logprobs"]
    whole = client.responses.create(**args, include=include, top_logprobs=2)
    messages = [{"role": "user", "content": QUESTION}]
    chat = _chat(servers["plain"], messages, 4, logprobs=True, top_logprobs=2)
    expected = chat["choices"][0]["logprobs"]["content"]
    [part] = whole.output[0].content
    assert [lp.model_dump() for lp in part.logprobs] == expected
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(**args, include=include, top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp.model_dump() for e in deltas for lp in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [lp.model_dump() for lp in done.logprobs] == expected
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == expected
    # Without include, no logprobs (vLLM's); top_logprobs=0: the chosen tokens' alone.
    assert client.responses.create(**args, top_logprobs=2).output[0].content[0].logprobs == []
    chosen = client.responses.create(**args, include=include).output[0].content[0].logprobs
    assert [(lp.token, lp.logprob, lp.top_logprobs) for lp in chosen] == [
        (lp["token"], lp["logprob"], []) for lp in expected
    ]
