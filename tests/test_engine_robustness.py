"""The engine survives what a user or a failing step can throw at it."""

import numpy as np
import pytest
from conftest import hf_greedy

from jvllm import LLM, SamplingParams

PROMPT = [(i * 53) % 30000 + 700 for i in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_a_failed_step_aborts_its_requests_and_leaves_no_bad_cache_entries(
    tiny_llama_dir, tiny_llama_hf, monkeypatch
):
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=128,
    )
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    free = manager.num_free_blocks
    runner = engine.model_runner

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "execute_model", broken)
    engine.add_request("doomed", PROMPT, GREEDY)
    outputs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("doomed", "abort")]
    assert not engine.has_unfinished_requests()
    assert manager.num_free_blocks == free
    monkeypatch.undo()
    # The same prompt again: its blocks must be computed, not taken from the failed step.
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama_hf, PROMPT, 6)


@pytest.mark.parametrize(
    "target, method",
    [
        ("model_runner", "execute_model"),
        ("output_processor", "detokenize"),
        ("output_processor", "_completion"),
    ],
)
def test_generate_raises_when_the_engine_aborts_a_request_for_a_failure(
    tiny_llama_dir, monkeypatch, target, method
):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, compile_all_buckets=False)
    engine = llm.llm_engine
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    expected = llm.generate([PROMPT, PROMPT[:20]], GREEDY, use_tqdm=False)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(getattr(engine, target), method, broken)
    with pytest.raises(RuntimeError, match="failed: .*injected failure"):
        llm.generate([PROMPT, PROMPT[:20]], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == free
    monkeypatch.undo()
    again = llm.generate([PROMPT, PROMPT[:20]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_a_block_size_that_is_not_a_power_of_two_gives_hf_tokens(tiny_llama_dir, tiny_llama_hf):
    long_prompt = [(i * 7) % 40000 + 200 for i in range(240)]
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        block_size=11,
        max_model_len=250,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    out = llm.generate([long_prompt, PROMPT], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_hf, long_prompt, 6)
    assert out[1].outputs[0].token_ids == hf_greedy(tiny_llama_hf, PROMPT, 6)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5])
def test_out_of_range_seeds_are_rejected_at_the_edge(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_max_model_len_beyond_the_model_is_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_llama_dir, max_model_len=4096, compile_all_buckets=False)


def test_warm_up_runs_write_only_the_null_page(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, compile_all_buckets=False)
    prompt = [[5, 6, 7] * 12]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.model_runner
    kv_before = np.asarray(runner.kv_cache)[:, :, :, 1:]  # [L, 2, K, P-1, B, H]
    tokens_before = np.asarray(runner.token_cache)[1:]  # [P-1, B]
    for bucket in (runner.buckets.select(1, 1), runner.buckets.select(40, 2)):
        runner._warm_up(bucket)
    assert runner.warmup_seconds > 0
    np.testing.assert_array_equal(np.asarray(runner.kv_cache)[:, :, :, 1:], kv_before)
    np.testing.assert_array_equal(np.asarray(runner.token_cache)[1:], tokens_before)
    # The prompt's cached blocks still give the same tokens.
    after = llm.generate(prompt, params, use_tqdm=False)
    assert after[0].outputs[0].token_ids == before
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
