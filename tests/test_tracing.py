"""Seed 003's request lifecycle, pinned through jvllm.tracing.trace_request."""

import itertools

from transformers import AutoTokenizer

from jvllm.tracing import trace_request

PROMPT = "hello there, general"


def _num_prompt_tokens(model_dir: str) -> int:
    return len(AutoTokenizer.from_pretrained(model_dir).encode(PROMPT))


def test_prefill_then_one_token_per_step_then_finished_length(tiny_llama_dir):
    p = _num_prompt_tokens(tiny_llama_dir)
    events = trace_request(
        PROMPT, max_tokens=4, model=tiny_llama_dir, max_num_seqs=8, max_num_batched_tokens=64
    )
    assert len(events) == 4  # steps == max_tokens when the prompt fits one prefill
    assert events[0] == ("req-0", "RUNNING", p, p + 1)  # prefill and first token in step 1
    for before, after in itertools.pairwise(events):
        assert after.num_computed_tokens == before.num_computed_tokens + 1
        assert after.num_tokens == before.num_tokens + 1
    assert [e.status for e in events[:-1]] == ["RUNNING"] * 3
    assert events[-1].status == "FINISHED_LENGTH"
    assert events[-1].num_tokens == p + 4


def test_chunked_prefill_climbs_by_the_threshold_without_new_tokens(tiny_llama_dir):
    p = _num_prompt_tokens(tiny_llama_dir)
    events = trace_request(
        PROMPT,
        max_tokens=4,
        model=tiny_llama_dir,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=2,
    )
    num_chunks = -(-p // 2)
    prefill = events[: num_chunks - 1]
    assert [e.num_computed_tokens for e in prefill] == [2 * (i + 1) for i in range(num_chunks - 1)]
    assert all(e.num_tokens == p and e.status == "RUNNING" for e in prefill)
    assert events[num_chunks - 1][2:] == (p, p + 1)  # the last chunk samples the first token
    assert events[-1].status == "FINISHED_LENGTH" and events[-1].num_tokens == p + 4
    assert len(events) == num_chunks + 3


def test_async_scheduling_keeps_the_lifecycle_of_each_step(tiny_llama_dir):
    """The step run ahead changes no request's counters: they move as each step ends."""
    kwargs = {"model": tiny_llama_dir, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    for chunking in ({}, {"long_prefill_token_threshold": 2}):
        sync = trace_request(PROMPT, max_tokens=6, **kwargs, **chunking)
        assert (
            trace_request(PROMPT, max_tokens=6, async_scheduling=True, **kwargs, **chunking) == sync
        )
