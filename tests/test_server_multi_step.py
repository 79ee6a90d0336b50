"""The server on an engine with decode windows and async scheduling: streams arrive in bursts of
k tokens (merged where the client falls behind) with the offline text, and a client that goes
away frees its blocks."""

import math

import openai
import pytest
from conftest import streamed_completion, wait_idle

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

MODEL = "tiny"
K = 4
PROMPTS = [f"Stream {i} goes on about" for i in range(3)]
MAX_TOKENS = 23


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_scheduler_steps=K,
        async_scheduling=True,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, MODEL, None)).start()
    yield {"engine": engine, "url": server.url, "offline": offline}
    server.stop()
    engine.shutdown()


def test_streams_come_in_windows_of_k_tokens_with_the_offline_text(setup):
    client = openai.OpenAI(base_url=setup["url"] + "/v1", api_key="unused", max_retries=0)
    for prompt, offline in zip(PROMPTS, setup["offline"]):
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        burst_sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs]
        assert sum(burst_sizes) == MAX_TOKENS
        # Windows of K after the first token: at most 1 + ceil(22 / K) chunks, fewer where the
        # client fell behind and the request's mailbox merged outputs (as vLLM's does).
        assert len(burst_sizes) <= 1 + math.ceil((MAX_TOKENS - 1) / K)
        assert max(burst_sizes) >= K
        assert "".join(c.choices[0].text for c in chunks) == offline


def test_a_client_that_goes_away_frees_its_blocks(setup):
    engine = setup["engine"]
    kv = engine.engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0] * 3,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with streamed_completion(setup["url"], body):
        assert kv.num_free_blocks < free_before  # the request holds blocks mid-stream
    wait_idle(engine)  # the disconnect aborted it
    assert kv.num_free_blocks == free_before
