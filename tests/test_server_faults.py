"""Load held and faults survived, on the tiny random model: `LLM` from two threads, clients that
go away, a bounded waiting queue, oversized requests, SIGTERM, and an engine loop that dies.

One engine per module (max_num_seqs 2), served in-process; its steps are slowed to 10 ms where a
test needs a request to still be running when something happens to it.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import scrape_metrics, wait_idle
from fastapi.testclient import TestClient

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.metrics import ServingMetrics
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 64 * 1024
LONG = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        compile_all_buckets=False,
    )


@pytest.fixture(scope="module")
def served(llm):
    engine = AsyncLLM(llm.llm_engine, max_waiting_requests=1)
    metrics = ServingMetrics(engine, MODEL)
    engine.stat_loggers.append(metrics)
    app = build_app(engine, MODEL, metrics=metrics, max_request_body_bytes=MAX_BODY_BYTES)
    server = ServerThread(app).start()
    yield {"engine": engine, "url": server.url}
    server.stop()
    engine.shutdown()


@pytest.fixture
def slow_steps(llm):
    """Each engine step takes 10 ms more, so a 200-token request runs for seconds."""
    engine = llm.llm_engine
    step = engine.step

    def slow_step():
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    yield
    del engine.step


def _num_free_blocks(llm) -> int:
    return llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks


def _num_generated_tokens(llm) -> int:
    return llm.llm_engine.scheduler.num_generation_tokens_total


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- LLM from several threads ----


def test_two_threads_calling_generate_each_get_the_single_threaded_outputs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {name: [f"{name} prompt {i}" for i in range(3)] for name in ("a", "b")}
    expected = {
        name: [o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)]
        for name, p in prompts.items()
    }
    free_before = _num_free_blocks(llm)
    results: dict[str, list] = {"a": [], "b": []}
    request_ids: list[str] = []

    def run(name: str) -> None:
        for _ in range(4):
            outputs = llm.generate(prompts[name], params, use_tqdm=False)
            results[name].append([o.outputs[0].token_ids for o in outputs])
            request_ids.extend(o.request_id for o in outputs)

    threads = [threading.Thread(target=run, args=(name,)) for name in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name, runs in results.items():
        assert runs == [expected[name]] * 4
    assert len(set(request_ids)) == len(request_ids) == 24
    assert not llm.llm_engine.has_unfinished_requests()
    assert _num_free_blocks(llm) == free_before
    again = llm.generate(prompts["a"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected["a"]


# ---- clients that go away, load, oversized requests ----


def test_client_timeout_aborts_a_non_streaming_request_and_frees_its_blocks(
    served, llm, slow_steps
):
    engine = served["engine"]
    wait_idle(engine)
    free_before = _num_free_blocks(llm)
    generated_before = _num_generated_tokens(llm)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served["url"] + "/v1/completions", json=LONG, timeout=0.5)
    wait_idle(engine, timeout=2.0)
    assert _num_free_blocks(llm) == free_before
    assert _num_generated_tokens(llm) - generated_before < LONG["max_tokens"]


def test_requests_past_the_waiting_bound_get_503_with_retry_after(served, slow_steps):
    engine = served["engine"]
    wait_idle(engine)

    async def main():
        async with httpx.AsyncClient(base_url=served["url"], timeout=30) as http:
            # 2 running (max_num_seqs) and 1 waiting (max_waiting_requests) fill the engine.
            admitted = [
                asyncio.create_task(http.post("/v1/completions", json=LONG)) for _ in range(3)
            ]
            while engine.engine.get_num_unfinished_requests() < 3:
                await asyncio.sleep(0.01)
            refused = await http.post("/v1/completions", json=LONG)
            for task in admitted:
                task.cancel()  # the clients go away: their requests abort
            await asyncio.gather(*admitted, return_exceptions=True)
            return refused

    refused = asyncio.run(main())
    error = _error(refused, 503)
    assert refused.headers["Retry-After"] == "1"
    assert error["type"] == "service_unavailable_error"
    assert "max_waiting_requests" in error["message"]
    wait_idle(engine)
    rejected = scrape_metrics(served["url"])[
        ("jvllm:num_requests_rejected_total", (("model_name", MODEL), ("reason", "overloaded")))
    ]
    assert rejected >= 1


def test_an_oversized_body_is_413_before_it_is_read(served, monkeypatch):
    engine = served["engine"].engine
    monkeypatch.setattr(engine, "add_request", lambda *a: pytest.fail("reached the engine"))
    big = {"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}
    url = served["url"] + "/v1/completions"
    assert "--max-request-body-bytes" in _error(httpx.post(url, json=big), 413)["message"]

    def chunks():  # no Content-Length: the limit holds on the bytes as they come
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    chunked = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"})
    _error(chunked, 413)


def test_a_prompt_text_too_long_for_max_model_len_is_400_without_tokenizing(served, monkeypatch):
    tokenizer = served["engine"].get_tokenizer()
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: pytest.fail("rendered"))
    text = "word " * (MAX_BODY_BYTES // 6)  # over 256 tokens of the longest entry (81 chars)
    url = served["url"]
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text})
    error = _error(response, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert str(len(text)) in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    error = _error(httpx.post(url + "/v1/chat/completions", json=chat), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


# ---- shutdown and a dying engine ----


def _stream_events(url: str, body: dict, events: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        events.extend(line for line in response.iter_lines() if line)


def test_stop_lets_short_streams_finish_and_aborts_the_rest_at_the_timeout(served, slow_steps):
    engine = served["engine"]
    wait_idle(engine)
    app = build_app(engine, MODEL)
    server = ServerThread(app, shutdown_timeout=1.0).start()
    short, long = [], []
    clients = [
        threading.Thread(target=_stream_events, args=(server.url, body, events))
        for body, events in (
            ({**LONG, "max_tokens": 10, "stream": True}, short),
            ({**LONG, "stream": True}, long),
        )
    ]
    for client in clients:
        client.start()
    _wait_until(lambda: len(short) > 0 and len(long) > 0)
    started = time.monotonic()
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    for client in clients:
        client.join(10)
    stopper.join(10)
    assert time.monotonic() - started < 1.0 + 3.0
    assert not server.thread.is_alive()
    assert short[-1] == long[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in short[-2]
    assert '"finish_reason": "abort"' in long[-2]
    wait_idle(engine)
    # The listener is closed; an app that drains also answers 503 on the connections left open.
    draining = TestClient(app)
    assert draining.get("/health").status_code == 503
    refused = draining.post("/v1/completions", json=LONG)
    assert _error(refused, 503)["type"] == "service_unavailable_error"
    assert refused.headers["Retry-After"] == "1"


class _EngineBug(BaseException):
    """Not an Exception: nothing on the way up catches it."""


def test_a_dead_engine_loop_fails_health_and_in_flight_requests_at_once(llm, slow_steps):
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL)).start()
    assert httpx.get(server.url + "/health").status_code == 200
    step = llm.llm_engine.step
    num_steps = 0

    def dying_step():
        nonlocal num_steps
        num_steps += 1
        if num_steps > 20:
            raise _EngineBug("the device went away")
        return step()

    llm.llm_engine.step = dying_step
    try:
        started = time.monotonic()
        response = httpx.post(server.url + "/v1/completions", json=LONG, timeout=30)
        assert time.monotonic() - started < 5.0
        assert "device went away" in _error(response, 500)["message"]
        assert httpx.get(server.url + "/health").status_code == 503
        streamed = httpx.post(server.url + "/v1/completions", json={**LONG, "stream": True})
        assert _error(streamed, 500)["type"] == "internal_server_error"
    finally:
        llm.llm_engine.step = step
        server.stop()
        engine.shutdown()
    assert not llm.llm_engine.has_unfinished_requests()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a `jvllm serve` process compiles its buckets: tens of seconds on a CPU
def test_sigterm_drains_jvllm_serve_and_exits_0(tiny_llama_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        *(sys.executable, "-m", "jvllm.entrypoints.cli", "serve", tiny_llama_dir),
        *("--port", str(port), "--served-model-name", MODEL, "--shutdown-timeout", "3"),
        *("--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64"),
        # Every shape compiled before it listens: a compile still running at exit would be
        # waited for (XLA cannot stop one), which is not what this test times.
        "--no-compile-in-background",
    ]
    process = subprocess.Popen(command, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        _wait_until(lambda: _is_healthy(url) or process.poll() is not None, timeout=300)
        assert process.poll() is None
        short, long = [], []
        clients = [
            threading.Thread(target=_stream_events, args=(url, body, events))
            for body, events in (
                ({**LONG, "max_tokens": 4, "stream": True}, short),
                ({**LONG, "max_tokens": 250 - 8, "stream": True}, long),
            )
        ]
        for client in clients:
            client.start()
        _wait_until(lambda: len(short) > 0 and len(long) > 0, timeout=60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=3 + 10) == 0  # the drain, then 10 s for the rest
        for client in clients:
            client.join(10)
        assert short[-1] == "data: [DONE]" and '"finish_reason": "length"' in short[-2]
        assert long[-1] == "data: [DONE]"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
