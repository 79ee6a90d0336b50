"""Greedy outputs of the whole engine, token for token against HF transformers."""

import pytest
from conftest import RAGGED_PROMPTS as PROMPTS
from conftest import hf_greedy

from jvllm import LLM, SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_expected(tiny_llama_hf):
    return [hf_greedy(tiny_llama_hf, p, MAX_TOKENS) for p in PROMPTS]


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_batch_matches_hf_token_for_token(tiny_llama_dir, hf_expected):
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=256,
        max_num_seqs=8,
        compile_all_buckets=True,
    )
    compiled = llm.llm_engine.model_runner.compiler.num_compilations
    assert compiled == len(llm.llm_engine.model_runner.buckets.all_buckets())
    assert _generate(llm) == hf_expected
    _generate(llm)
    assert (
        llm.llm_engine.model_runner.compiler.num_compilations == compiled
    )  # nothing on the hot path


def test_chunked_prefill_gives_identical_tokens(tiny_llama_dir, hf_expected):
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        max_num_seqs=8,
        long_prefill_token_threshold=5,
    )
    assert _generate(llm) == hf_expected


def test_preempted_requests_resume_with_identical_tokens(tiny_llama_dir, hf_expected):
    # 14 usable blocks of 4 tokens: the five requests (up to 69 tokens each) cannot all fit.
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert _generate(llm) == hf_expected
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 23  # every block back in the pool


def test_repeated_prefix_hits_the_prefix_cache(tiny_llama_dir, tiny_llama_hf):
    prefix = [(i * 31) % 30000 + 500 for i in range(40)]
    first, second = prefix + [11, 12], prefix + [13, 14, 15]
    llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=128, max_num_seqs=8)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert _generate(llm, [first]) == [hf_greedy(tiny_llama_hf, first, MAX_TOKENS)]
    hits_before = manager.prefix_cache_hits
    out = llm.generate(
        [second], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_hf, second, MAX_TOKENS)
    assert manager.prefix_cache_hits - hits_before == 32  # two full blocks of 16 reused
    assert out[0].num_cached_tokens == 32
