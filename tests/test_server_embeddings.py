"""/v1/embeddings through the official `openai` client on a server started with runner
"pooling", against the same engine's offline embeddings; each runner's routes refused on the
other's server."""

import base64

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from jvllm import LLM
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny-embed"
TEXTS = ["Request number one says hello", "a second, longer input about embeddings and more"]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, runner="pooling", max_model_len=64, max_num_batched_tokens=16)
    offline = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    token_ids = [o.prompt_token_ids for o in llm.embed(TEXTS, use_tqdm=False)]
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL)).start()
    yield {"url": server.url, "offline": offline, "token_ids": token_ids}
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(setup):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key="unused", max_retries=0)


def test_openai_client_gets_the_offline_embeddings(setup, client):
    """float, and base64 (little-endian float32): the client asks for it when no format is
    given and decodes it; text and token-id inputs; usage counts every prompt token."""
    num_tokens = sum(map(len, setup["token_ids"]))
    for encoding_format in ("float", "base64", openai.NOT_GIVEN):
        reply = client.embeddings.create(
            model=MODEL, input=TEXTS, encoding_format=encoding_format, user="u"
        )
        assert [d.index for d in reply.data] == [0, 1] and reply.model == MODEL
        for got, want in zip(reply.data, setup["offline"]):
            if encoding_format == "base64":  # asked for by the caller: left to it to decode
                got.embedding = np.frombuffer(base64.b64decode(got.embedding), "<f4")
            np.testing.assert_allclose(got.embedding, want, rtol=1e-6, atol=1e-6)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens
    reply = client.embeddings.create(model=MODEL, input=setup["token_ids"][1])
    np.testing.assert_allclose(reply.data[0].embedding, setup["offline"][1], rtol=1e-6, atol=1e-6)

    raw = httpx.post(
        setup["url"] + "/v1/embeddings",
        json={"model": MODEL, "input": TEXTS[0], "normalize": False},
    ).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"
    assert np.linalg.norm(raw["data"][0]["embedding"]) != pytest.approx(1.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),  # not a matryoshka model
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        # Refused in the engine: the prompt's field is the one it came in.
        ({"input": [10**9]}, "input"),
        ({"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_field(setup, body, param):
    reply = httpx.post(setup["url"] + "/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_chat_embedding_request_embeds_the_rendered_conversation(setup, tiny_llama_dir):
    """vLLM's chat embedding request: `messages` in place of `input`, rendered under the chat
    template (no generation prompt by default) and embedded as one prompt."""
    messages = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": "hi"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    url = setup["url"] + "/v1/embeddings"
    for extra in ({}, {"add_generation_prompt": True}):
        ids = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
        ids = tokenizer.encode(ids, add_special_tokens=False)
        body = {"model": MODEL, "messages": messages, **extra}
        reply = httpx.post(url, json=body).json()
        want = httpx.post(url, json={"model": MODEL, "input": ids}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(reply["data"][0]["embedding"], want["data"][0]["embedding"])
    for body in ({}, {"input": "hi", "messages": messages}):
        reply = httpx.post(url, json={"model": MODEL, **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"


def test_each_runner_refuses_the_others_routes(setup, tiny_llama_dir):
    reply = httpx.post(
        setup["url"] + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert reply.status_code == 400 and "embedding model" in reply.json()["error"]["message"]

    generating = AsyncLLM(LLM(tiny_llama_dir, max_model_len=64).llm_engine)
    server = ServerThread(build_app(generating, MODEL)).start()
    try:
        reply = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert reply.status_code == 400
        assert "--runner pooling" in reply.json()["error"]["message"]
    finally:
        server.stop()
        generating.shutdown()
