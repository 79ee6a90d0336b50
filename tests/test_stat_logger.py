"""The server's periodic stats line and the token counters behind it."""

import asyncio
import logging

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.stat_logger import INTERVAL_ENV, LoggingStatLogger, SchedulerStats


@pytest.fixture
def lines():
    """Messages logged by the stat logger (jvllm's loggers do not propagate to the root)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("jvllm.engine.stat_logger")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def test_logs_rates_once_per_interval_then_once_quiet(lines):
    stat_logger = LoggingStatLogger(interval=10.0)
    stat_logger.maybe_log(SchedulerStats(), 0.0)
    busy = SchedulerStats(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=4,
        prefix_cache_hits=1,
        num_prompt_tokens=200,
        num_generation_tokens=50,
    )
    stat_logger.maybe_log(busy, 4.0)  # too soon
    assert lines == []
    stat_logger.maybe_log(busy, 10.0)
    assert lines[-1].getMessage() == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    quiet = SchedulerStats(
        prefix_cache_queries=4, prefix_cache_hits=1, num_prompt_tokens=200, num_generation_tokens=50
    )
    stat_logger.maybe_log(quiet, 20.0)  # the engine went quiet: one line of zeros
    assert len(lines) == 2 and "Avg generation throughput: 0.0 tokens/s" in lines[-1].getMessage()
    stat_logger.maybe_log(quiet, 30.0)
    assert len(lines) == 2


def test_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert LoggingStatLogger().interval == 2.5
    for bad in ("0", "ten"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=f"{INTERVAL_ENV} must be .* got '{bad}'"):
            LoggingStatLogger()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, max_model_len=128, max_num_seqs=4, compile_all_buckets=False)


def test_counters_count_computed_prompt_tokens_and_sampled_tokens(llm):
    scheduler = llm.llm_engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16
    before = scheduler.num_prompt_tokens_total, scheduler.num_generation_tokens_total
    llm.generate([prompt], params, use_tqdm=False)
    llm.generate([prompt], params, use_tqdm=False)  # 32 tokens come from the prefix cache
    assert scheduler.num_prompt_tokens_total - before[0] == 40 + 8
    assert scheduler.num_generation_tokens_total - before[1] == 10


def test_async_engine_logs_stats_while_serving(llm, lines, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.001")
    engine = AsyncLLM(llm.llm_engine, log_stats=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run():
        async for _ in engine.generate("Hello there", params, request_id="stats-0"):
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    messages = [r.getMessage() for r in lines]
    assert any("Avg generation throughput" in m and "Running: 1 reqs" in m for m in messages)
    # The first step computes the prompt: its tokens count from the engine's start, not after.
    assert any(
        "Avg prompt throughput" in m and "prompt throughput: 0.0 " not in m for m in messages
    )
