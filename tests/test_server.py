"""The OpenAI-compatible server on the tiny random model, through the official `openai` client.

One in-process server per module (so a test can look at the engine's block pool); offline
`LLM.generate` references are taken on the same engine before the server starts.
"""

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import scrape_metrics, streamed_completion, wait_idle
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.metrics import ServingMetrics
from jvllm.entrypoints import cli
from jvllm.entrypoints.openai import api_server
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.engine_errors import param_of
from jvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny"
API_KEY = "sekret"
PROMPTS = [f"Request number {i} says hello to" for i in range(32)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir,
        max_model_len=256,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        compile_all_buckets=False,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    engine = AsyncLLM(llm.llm_engine)
    metrics = ServingMetrics(engine, MODEL)
    engine.stat_loggers.append(metrics)
    server = ServerThread(build_app(engine, MODEL, None, metrics)).start()
    secured = ServerThread(build_app(engine, MODEL, API_KEY)).start()
    yield {"engine": engine, "url": server.url, "secured_url": secured.url, "offline": offline}
    server.stop()
    secured.stop()
    engine.shutdown()


@pytest.fixture
def client(setup):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key="unused", max_retries=0)


def _greedy(**kw):
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "extra_body": {"ignore_eos": True},
        **kw,
    }


def test_completion_streamed_equals_non_streamed_equals_offline(setup, client):
    non_streamed = client.completions.create(prompt=PROMPTS[0], **_greedy())
    chunks = list(client.completions.create(prompt=PROMPTS[0], stream=True, **_greedy()))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert non_streamed.choices[0].text == streamed == setup["offline"][0]
    assert non_streamed.choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].finish_reason == "length"
    usage = non_streamed.usage
    assert usage.completion_tokens == MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + MAX_TOKENS


def test_completion_prompt_list_token_ids_and_echo(setup, client):
    tokenizer = setup["engine"].get_tokenizer()
    ids = tokenizer.encode(PROMPTS[1])
    out = client.completions.create(prompt=[PROMPTS[0], PROMPTS[1]], **_greedy())
    assert [c.text for c in out.choices] == setup["offline"][:2]
    assert client.completions.create(prompt=ids, **_greedy()).choices[0].text == setup["offline"][1]
    echoed = client.completions.create(prompt=PROMPTS[2], echo=True, **_greedy())
    assert echoed.choices[0].text == PROMPTS[2] + setup["offline"][2]


def test_chat_stream_has_role_deltas_finish_usage_and_done(setup, client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(messages=messages, **_greedy())
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **_greedy()
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    # The raw stream ends with [DONE].
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True}
    raw = httpx.post(setup["url"] + "/v1/chat/completions", json=body, timeout=30).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_chat_max_completion_tokens_wins_over_max_tokens(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def _needs_engine_field(name: str):
    from jvllm.outputs import CompletionOutput

    fields = {f.name for f in __import__("dataclasses").fields(CompletionOutput)}
    if name not in fields:
        pytest.skip(f"the engine's CompletionOutput has no `{name}` field yet (issue 4)")


def test_n2_returns_two_choices_streamed_and_not(client):
    try:
        SamplingParams(n=2)
    except ValueError as e:
        pytest.skip(f"SamplingParams does not support n=2 yet (issue 4): {e}")
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        n=2,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            max_tokens=5,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finished = {c.index for ch in chunks for c in ch.choices if c.finish_reason}
    assert finished == {0, 1}
    texts = [
        "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == i)
        for i in (0, 1)
    ]
    assert all(texts)


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_chat_stream_sends_each_choices_last_delta_in_its_finish_chunk(setup, finish_reason):
    """vLLM's last chunk of a choice holds its last delta (text, logprobs) with the finish_reason:
    never an empty content chunk followed by a bare finish chunk."""
    eos = setup["engine"].get_tokenizer().eos_token_id
    ends = {  # 3 tokens then EOS; or 5 tokens, EOS or not
        "stop": {"max_tokens": 8, "min_tokens": 3, "logit_bias": {str(eos): 100}},
        "length": {"max_tokens": 5, "ignore_eos": True},
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "seed": 7,
        "logprobs": True,
        **ends[finish_reason],
    }
    url = setup["url"] + "/v1/chat/completions"
    full = httpx.post(url, json=body, timeout=60).json()
    raw = httpx.post(url, json={**body, "stream": True}, timeout=60).text
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    for choice in full["choices"]:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert mine[0]["delta"]["role"] == "assistant"
        *deltas, last = mine[1:]
        assert [c["finish_reason"] for c in deltas] == [None] * len(deltas)
        assert all(c["delta"]["content"] for c in deltas)  # no empty content chunk
        assert last["finish_reason"] == choice["finish_reason"] == finish_reason
        if finish_reason == "stop":
            assert last["delta"] == {"content": ""}  # EOS's text: vLLM's last chunk
        else:
            assert last["delta"]["content"]
        assert len(last["logprobs"]["content"]) == 1
        streamed = [e for c in mine[1:] for e in c["logprobs"]["content"]]
        whole = choice["logprobs"]["content"]
        assert [e["token"] for e in streamed] == [e["token"] for e in whole]
        assert [e["logprob"] for e in streamed] == pytest.approx(
            [e["logprob"] for e in whole], abs=1e-4
        )
        text = "".join(c["delta"]["content"] for c in mine[1:])
        assert text == choice["message"]["content"]


def test_logprobs_completions_and_chat(client):
    _needs_engine_field("logprobs")
    out = client.completions.create(prompt=PROMPTS[4], logprobs=3, **_greedy(max_tokens=4))
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the best token
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **_greedy(max_tokens=4),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    streamed = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **_greedy(max_tokens=4),
        )
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_32_concurrent_streams_finish_with_offline_text(setup):
    async def one(client, i):
        stream = await client.completions.create(prompt=PROMPTS[i], stream=True, **_greedy())
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=setup["url"] + "/v1", api_key="x", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == setup["offline"]


def test_disconnect_mid_stream_aborts_and_frees_every_block(setup):
    engine = setup["engine"]
    kv = engine.engine.scheduler.kv_cache_manager
    wait_idle(engine)
    free_before = kv.num_free_blocks
    generated_before = _generation_tokens(setup["url"])
    body = {
        "model": MODEL,
        "prompt": PROMPTS[5] * 4,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with streamed_completion(setup["url"], body):
        assert kv.num_free_blocks < free_before  # the request holds blocks mid-stream
    wait_idle(engine)
    assert kv.num_free_blocks == free_before
    assert _generation_tokens(setup["url"]) - generated_before < 200  # it did not run to the end


LABEL = (("model_name", MODEL),)


def _generation_tokens(url: str) -> float:
    return scrape_metrics(url).get(("jvllm:generation_tokens_total", LABEL), 0.0)


def _success(samples: dict, reason: str) -> float:
    labels = tuple(sorted({"model_name": MODEL, "finished_reason": reason}.items()))
    return samples[("jvllm:request_success_total", labels)]


def test_gauges_read_zero_right_after_the_last_request_is_aborted(setup):
    engine = setup["engine"]
    wait_idle(engine)
    aborted_before = _success(scrape_metrics(setup["url"]), "abort")
    body = {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 200, "stream": True}
    with streamed_completion(setup["url"], {**body, "ignore_eos": True}):
        busy = scrape_metrics(setup["url"])
        assert busy[("jvllm:num_requests_running", LABEL)] == 1
        assert busy[("jvllm:kv_cache_usage_perc", LABEL)] > 0
    # No step runs after the abort: the engine thread refreshes the stats when it applies it.
    deadline = time.monotonic() + 5
    while scrape_metrics(setup["url"])[("jvllm:num_requests_running", LABEL)] != 0:
        assert time.monotonic() < deadline, "num_requests_running stayed above 0 when idle"
        time.sleep(0.02)
    idle = scrape_metrics(setup["url"])
    assert idle[("jvllm:num_requests_waiting", LABEL)] == 0
    assert idle[("jvllm:kv_cache_usage_perc", LABEL)] == 0
    assert _success(idle, "abort") == aborted_before + 1


def test_a_bad_prompt_among_several_refuses_the_request_before_any_runs(setup):
    url = setup["url"]
    wait_idle(setup["engine"])
    before = scrape_metrics(url)
    for prompt in ([[5, 6, 7], [10**9]], [[10**9], [5, 6, 7]]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        assert _error(httpx.post(url + "/v1/completions", json=body), 400)["param"] == "prompt"
    after = scrape_metrics(url)
    # Nothing was added and aborted: the good prompt never ran.
    assert _success(after, "abort") == _success(before, "abort")
    assert _generation_tokens(url) == before.get(("jvllm:generation_tokens_total", LABEL), 0.0)


def test_400s_on_generation_routes_count_as_rejected(setup):
    url = setup["url"]
    key = (
        "jvllm:num_requests_rejected_total",
        (("model_name", MODEL), ("reason", "invalid_request")),
    )
    before = scrape_metrics(url).get(key, 0.0)
    too_long = {"model": MODEL, "prompt": list(range(100, 400)), "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=too_long).status_code == 400  # OpenAIError
    invalid = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 2}
    assert httpx.post(url + "/v1/chat/completions", json=invalid).status_code == 400  # pydantic
    assert httpx.post(url + "/tokenize", json={}).status_code == 400  # generates nothing
    assert scrape_metrics(url)[key] == before + 2


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 2}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "n": "many"}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        # Refused in the engine, which knows the vocabulary and max_logprobs.
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "hi", "logit_bias": {"1000000": 1}}, "logit_bias"),
        ({"prompt": "hi", "allowed_token_ids": [1000000]}, "allowed_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [1000000]}, "stop_token_ids"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21},
            "prompt_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1000000": 1}},
            "logit_bias",
        ),
        # A wrong type in a union field names the field, not pydantic's member ("prompt.str").
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "hi", "stop": 123}, "stop"),
        # max_tokens past what the prompt leaves names the field the request set it with.
        ({"prompt": "hi", "max_tokens": 300}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300},
            "max_completion_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
            "max_completion_tokens",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        # vLLM's refusal of both: a reply continues the last message or starts a new one.
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Hello"},
                ],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
        ),
    ],
)
def test_out_of_range_params_are_400_naming_the_field(setup, body, param):
    path = "/v1/completions"
    if "messages" in body:
        path = "/v1/chat/completions"
    elif "input" in body:
        path = "/v1/responses"
    response = httpx.post(setup["url"] + path, json={"model": MODEL, **body})
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", r'{"prompt": "hi \ud800"}', "prompt"),
        (
            "/v1/chat/completions",
            r'{"messages": [{"role": "user", "content": "\udc00"}]}',
            "messages.0.content",
        ),
        ("/v1/responses", r'{"input": "hi", "user": "\ud800", "max_output_tokens": 1}', "user"),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(setup, path, body, param):
    r"""JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer takes and no UTF-8
    reply can carry: refused before any work (it was a 500, the Responses API's after generating)."""
    headers = {"Content-Type": "application/json"}
    response = httpx.post(setup["url"] + path, content=body, headers=headers)
    assert _error(response, 400)["param"] == param
    pair = r'{"model": "tiny", "prompt": "\ud83d\ude00", "max_tokens": 1}'  # one character
    response = httpx.post(setup["url"] + "/v1/completions", content=pair, headers=headers)
    assert response.status_code == 200, response.text


def test_param_is_the_first_request_field_an_error_message_names():
    chat, completion = ChatCompletionRequest.model_fields, CompletionRequest.model_fields
    assert param_of("min_tokens must be <= max_tokens (10), got 20", chat) == "min_tokens"
    # "prompt" names the field the prompt came in; "this model" is not the `model` field.
    assert param_of("the prompt (9 tokens) plus max_tokens (9) is 18 tokens", chat) == "messages"
    assert param_of("this model ships no tokenizer: pass the prompt as ids", completion) == "prompt"
    assert param_of("params must be a SamplingParams, got dict", completion) is None


def test_malformed_json_is_400_and_unknown_model_404(setup):
    url = setup["url"] + "/v1/chat/completions"
    response = httpx.post(
        url,
        content=b'{"model": "tiny", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    assert "JSON" in _error(response, 400)["message"]
    response = httpx.post(
        url, json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}
    )
    error = _error(response, 404)
    assert error["param"] == "model" and "gpt-5" in error["message"]


def test_prompt_longer_than_max_model_len_is_400_with_both_counts(setup):
    prompt = list(range(100, 400))  # 300 tokens > max_model_len 256
    response = httpx.post(
        setup["url"] + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10}
    )
    message = _error(response, 400)["message"]
    assert "256" in message and "300" in message


@pytest.mark.parametrize("max_tokens", [None, 1])
def test_a_prompt_of_max_model_len_tokens_is_400_as_offline_and_in_vllm(setup, max_tokens):
    """vLLM v1 refuses a generation prompt of exactly max_model_len tokens (no room for one
    output token); so does the offline engine (test_engine_api.py), and so does the server."""
    url = setup["url"] + "/v1/completions"
    body = {"model": MODEL, "prompt": [5] * 256, "max_tokens": max_tokens}
    error = _error(httpx.post(url, json=body), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    fits = httpx.post(url, json={**body, "prompt": [5] * 255}).json()
    assert fits["usage"]["completion_tokens"] == 1


def test_api_key_is_required_on_v1(setup):
    url = setup["secured_url"]
    assert _error(httpx.get(url + "/v1/models"), 401)["code"] == "invalid_api_key"
    for path in ("/score", "/rerank", "/v2/rerank"):  # /v1's work on other paths: keyed too
        _error(httpx.post(url + path, json={}), 401)
    wrong = {"Authorization": "Bearer nope"}
    _error(httpx.get(url + "/v1/models", headers=wrong), 401)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
    assert httpx.get(url + "/health").status_code == 200


_PREFLIGHT = {
    "Origin": "http://a",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def test_browser_preflight_and_requests_get_cors_headers_by_default(setup):
    url = setup["secured_url"]  # the key guards the request, never its preflight
    preflight = httpx.options(url + "/v1/chat/completions", headers=_PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in preflight.headers
    keyed = {"Origin": "http://a", "Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(url + "/v1/models", headers=keyed)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(url + "/v1/models", headers={"Origin": "http://a"})
    assert refused.status_code == 401  # readable by the page: it carries the allow header too
    assert refused.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_leave_other_origins_without_an_allow_header(setup):
    app = build_app(
        setup["engine"], MODEL, API_KEY, allowed_origins=["http://a"], allow_credentials=True
    )
    server = ServerThread(app).start()
    try:
        preflight = httpx.options(server.url + "/v1/chat/completions", headers=_PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://a"
        assert preflight.headers["access-control-allow-credentials"] == "true"
        other = {**_PREFLIGHT, "Origin": "http://b"}
        refused = httpx.options(server.url + "/v1/chat/completions", headers=other)
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        keyed = {"Origin": "http://b", "Authorization": f"Bearer {API_KEY}"}
        models = httpx.get(server.url + "/v1/models", headers=keyed)
        assert models.status_code == 200 and "access-control-allow-origin" not in models.headers
        _error(httpx.post(server.url + "/v1/chat/completions", json={}), 401)
    finally:
        server.stop()


def test_models_health_version_tokenize_detokenize(setup, client):
    url = setup["url"]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").json()["version"]
    tokens = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = httpx.post(
        url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat_tokens["count"] > tokens["count"]


def test_metrics_parse_and_counters_move(setup, client):
    def scrape() -> dict:
        return scrape_metrics(setup["url"])

    label = LABEL
    before = scrape()
    client.completions.create(prompt=PROMPTS[6], **_greedy())
    after = scrape()
    for name in (
        "jvllm:num_requests_running",
        "jvllm:num_requests_waiting",
        "jvllm:kv_cache_usage_perc",
        "jvllm:prefix_cache_hit_rate",
    ):
        assert (name, label) in after
    generated = ("jvllm:generation_tokens_total", label)
    assert after[generated] - before.get(generated, 0) == MAX_TOKENS
    prompt = ("jvllm:prompt_tokens_total", label)
    assert after[prompt] > before.get(prompt, 0)
    for hist in ("jvllm:time_to_first_token_seconds", "jvllm:e2e_request_latency_seconds"):
        key = (hist + "_count", label)
        assert after[key] == before.get(key, 0) + 1
    itl = ("jvllm:inter_token_latency_seconds_count", label)
    assert after[itl] - before.get(itl, 0) == MAX_TOKENS - 1
    queries = ("jvllm:prefix_cache_queries_total", label)
    assert after[queries] > before.get(queries, 0)

    def moved(name: str) -> float:
        return after[(name, label)] - before.get((name, label), 0)

    assert _success(after, "length") == _success(before, "length") + 1
    for hist in (
        "request_prompt_tokens",
        "request_params_n",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
    ):
        assert moved(f"jvllm:{hist}_count") == 1, hist
    assert moved("jvllm:request_generation_tokens_sum") == MAX_TOKENS
    assert moved("jvllm:request_max_num_generation_tokens_sum") == MAX_TOKENS
    assert moved("jvllm:request_params_max_tokens_sum") == MAX_TOKENS
    # Every step computed some tokens: the prompt's (less any prefix cache hits), then one each.
    assert moved("jvllm:iteration_tokens_total_sum") >= MAX_TOKENS
    assert moved("jvllm:iteration_tokens_total_count") >= MAX_TOKENS - 1
    [info] = [labels for name, labels in after if name == "jvllm:cache_config_info"]
    kv = setup["engine"].engine.scheduler.kv_cache_manager
    assert dict(info)["num_gpu_blocks"] == str(kv.num_blocks)
    assert dict(info)["block_size"] == str(kv.block_size)


def test_iteration_tokens_observe_each_step_with_the_tokens_it_computed(setup, client, monkeypatch):
    """vLLM's iteration_tokens_total: one observation per engine step that scheduled tokens, of
    the prompt tokens it computed (prefix-cache hits excluded) plus the tokens it generated."""
    engine = setup["engine"]
    scheduler = engine.engine.scheduler
    schedule = scheduler.schedule
    num_steps = 0

    def counting_schedule():
        nonlocal num_steps
        output = schedule()
        num_steps += output.total_num_scheduled_tokens > 0
        return output

    def prefix_cache_hits() -> int:
        # Read on the engine thread between steps: every earlier step has been recorded by then.
        kv = scheduler.kv_cache_manager
        return asyncio.run(engine.call_engine(lambda _: kv.prefix_cache_hits))

    def complete(job):
        prompt, max_tokens = job
        return client.completions.create(prompt=prompt, **_greedy(max_tokens=max_tokens)).usage

    wait_idle(engine)
    hits_before = prefix_cache_hits()
    before = scrape_metrics(setup["url"])
    monkeypatch.setattr(scheduler, "schedule", counting_schedule)
    jobs = [(PROMPTS[8], 3), (PROMPTS[9] * 2, 6), (PROMPTS[10] * 3, 9)]  # prefills and decodes mix
    with ThreadPoolExecutor(len(jobs)) as pool:
        usages = list(pool.map(complete, jobs))
    wait_idle(engine)
    num_hits = prefix_cache_hits() - hits_before
    after = scrape_metrics(setup["url"])

    def moved(name: str) -> float:
        return after[(name, LABEL)] - before[(name, LABEL)]

    assert [u.completion_tokens for u in usages] == [max_tokens for _, max_tokens in jobs]
    num_tokens = sum(u.prompt_tokens + u.completion_tokens for u in usages) - num_hits
    assert moved("jvllm:iteration_tokens_total_count") == num_steps > 0
    assert moved("jvllm:iteration_tokens_total_sum") == num_tokens


# The series vLLM's Grafana dashboard reads (examples/observability/prometheus_grafana).
_VLLM_DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_success",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
}


def test_vllm_prefix_names_every_series_as_vllm_does(setup):
    metrics = ServingMetrics(setup["engine"], MODEL, prefix="vllm")
    text = generate_latest(metrics.registry).decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert all(name.startswith("vllm:") for name in names)
    assert _VLLM_DASHBOARD_SERIES <= names
    assert {"vllm:iteration_tokens_total", "vllm:cache_config_info"} <= names
    default = {n.replace("jvllm:", "vllm:", 1) for n in _family_names(setup["url"])}
    assert default == names  # the same series, only the prefix differs
    with pytest.raises(ValueError, match="metrics prefix must be a Prometheus name"):
        ServingMetrics(setup["engine"], MODEL, prefix="v-llm")


def _family_names(url: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def test_serve_passes_the_metrics_prefix_to_the_server(monkeypatch):
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: calls.append(kw))
    cli.main(["serve", "--metrics-prefix", "vllm"])
    cli.main(["serve"])
    assert [kw["metrics_prefix"] for kw in calls] == ["vllm", "jvllm"]


def test_serve_refuses_flags_that_need_another(monkeypatch):
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: calls.append(kw))
    harmony = ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "openai"]
    with pytest.raises(SystemExit, match="pass --reasoning-parser openai_gptoss too"):
        cli.main(harmony)
    with pytest.raises(SystemExit, match="--lora-modules needs --enable-lora"):
        cli.main(["serve", "--lora-modules", "sql=/a"])
    cli.main([*harmony, "--reasoning-parser", "openai_gptoss"])
    cli.main(["serve", "--enable-lora", "--lora-modules", "sql=/a"])
    assert [kw["reasoning_parser"] for kw in calls] == ["openai_gptoss", None]
    assert calls[1]["lora_modules"][0].lora_path == "/a"


def test_serve_passes_the_cors_flags_to_the_server(monkeypatch):
    calls = []
    monkeypatch.setattr(api_server, "run_server", lambda *a, **kw: calls.append(kw))
    cli.main(["serve"])
    origins, methods = '["http://a", "http://b"]', '["GET", "POST"]'
    cli.main(["serve", "--allowed-origins", origins, "--allowed-methods", methods])
    cli.main(["serve", "--allowed-headers", '["authorization"]', "--allow-credentials"])
    cors = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")
    assert [[kw[k] for k in cors] for kw in calls] == [
        [["*"], ["*"], ["*"], False],
        [["http://a", "http://b"], ["GET", "POST"], ["*"], False],
        [["*"], ["*"], ["authorization"], True],
    ]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--allowed-origins", "http://a"])  # not a JSON list
