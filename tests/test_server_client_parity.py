"""Requests that clients written against vLLM's server send, answered as vLLM answers them: the
tiny random model (SmolLM2's tokenizer) behind the OpenAI-compatible app, under a chat template
that writes the tools into the prompt (as Qwen's and Llama's do; SmolLM2's leaves them out)."""

import httpx
import pytest

from jvllm import LLM
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny"
TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MESSAGES = [{"role": "user", "content": "What time is it in Tokyo?"}]
TIMEZONE = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIMEZONE}}]


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, max_model_len=256, max_num_seqs=4, compile_all_buckets=False)
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL, chat_template=TEMPLATE)).start()
    yield server.url
    server.stop()
    engine.shutdown()


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_messages_with_tools_counts_the_chat_prompt(url):
    """vLLM's /tokenize takes a chat request's `tools` and renders them into the prompt, so its
    count is what /v1/chat/completions sends the model (token counters for tool-using agents)."""
    chat = _post(
        url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 1,
            "return_token_ids": True,
        },
    )
    with_tools = _post(url, "/tokenize", {"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    without = _post(url, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert with_tools["tokens"] == chat["prompt_token_ids"]
    assert with_tools["count"] == chat["usage"]["prompt_tokens"] > without["count"]
    # A template keyword argument of the same name still wins, as in a chat completion.
    overridden = _post(
        url,
        "/tokenize",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": TOOLS,
            "chat_template_kwargs": {"tools": None},
        },
    )
    assert overridden["tokens"] == without["tokens"]


def test_models_cards_carry_vllms_permission_list(url):
    """vLLM's /v1/models cards each hold OpenAI's legacy `permission` list of one entry."""
    (card,) = httpx.get(url + "/v1/models").json()["data"]
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission"
    assert permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"]
    assert permission["organization"] == "*" and permission["group"] is None
