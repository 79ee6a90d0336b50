"""The server on the default model (SmolLM2-135M-Instruct): a real chat answer, streamed and not,
equal to offline `LLM.generate` on the same chat-templated prompt."""

import openai
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread
from jvllm.model_loader.default_model import DEFAULT_MODEL

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    # Its own engine (AsyncLLM takes it over), with the shapes the other SmolLM2 tests compiled.
    llm = LLM(smollm2_dir, **SMOLLM2_ENGINE_KWARGS)
    prompt_ids = llm.get_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    offline = (
        llm.generate(
            [list(prompt_ids)], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, DEFAULT_MODEL)).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0), offline
    server.stop()
    engine.shutdown()


def test_default_model_chat_streamed_equals_offline(served):
    client, offline = served
    kwargs = {"model": DEFAULT_MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 20}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full == streamed == offline
    assert "Paris" in full
