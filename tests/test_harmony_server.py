"""gpt-oss's harmony parsers in the chat server, through the official client: the default model,
its reply scripted by a regex into harmony's messages, comes back as reasoning and a tool call,
whole and streamed (test_harmony_parsers.py pins the parsing itself)."""

import json
import re

import openai
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS

from jvllm import LLM
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.reasoning import REASONING_PARSERS
from jvllm.entrypoints.openai.server_thread import ServerThread
from jvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from jvllm.entrypoints.openai.tool_parsers import OpenAIToolParser

MODEL = "smol"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# An analysis message, then a call as gpt-oss writes one (the reply stops at its <|call|>).
CALL_REPLY = (
    r"<\|channel\|>analysis<\|message\|>[a-z]{2,8}<\|end\|><\|start\|>assistant<\|channel\|>"
    r"commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>"
    r'\{"city": "[A-Z][a-z]{2,6}"\}'
)


@pytest.fixture(scope="module")
def served(smollm2_dir):
    engine = AsyncLLM(LLM(smollm2_dir, **SMOLLM2_ENGINE_KWARGS).llm_engine)
    app = build_app(engine, MODEL, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    server = ServerThread(app).start()
    yield {"engine": engine, "url": server.url}
    server.stop()
    engine.shutdown()


def test_a_harmony_reply_is_reasoning_and_a_tool_call_whole_and_streamed(served):
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0,
        "extra_body": {"guided_regex": CALL_REPLY},
    }
    choice = client.chat.completions.create(**body).choices[0]
    message = choice.message
    assert choice.finish_reason == "tool_calls" and message.content is None
    assert re.fullmatch("[a-z]{2,8}", message.reasoning_content)
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    assert re.fullmatch(r'\{"city": "[A-Z][a-z]{2,6}"\}', call.function.arguments)
    reasoning, content, arguments, finish = "", "", "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            assert entry.function.name in (None, "get_weather")
            arguments += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (message.reasoning_content, "", "tool_calls")
    assert json.loads(arguments) == json.loads(call.function.arguments)


def test_harmonys_parsers_make_the_server_keep_special_tokens(served):
    engine, gpt_oss = served["engine"], REASONING_PARSERS["openai_gptoss"]
    for reasoning, tools, reads in [
        (None, None, False),
        (REASONING_PARSERS["qwen3"], None, False),
        (gpt_oss, None, True),
        (None, OpenAIToolParser, True),
    ]:
        chat = OpenAIServingChat(engine, MODEL, False, tools, reasoning_parser=reasoning)
        assert chat.reads_special_tokens is reads
