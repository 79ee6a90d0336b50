"""Async scheduling in a group of data-parallel ranks whose MoE layers run across them
(worker/rank_group.py): the group's next decode step dispatched ahead of the ranks' schedules,
used where it holds every rank's step and dropped where one rank's differs, giving the tokens
of the group without it (and of one device)."""

import pytest
from family_parity import ragged_prompts
from test_data_parallel_moe import (
    ENGINE_KWARGS,
    GREEDY,
    VOCAB,
    group_llm,
    model_dir,
    run_with_arrivals,
)

from jvllm import LLM, SamplingParams

__all__ = ["model_dir"]  # the fixture, shared with test_data_parallel_moe.py


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("t", [1, 2])
def test_ranks_decode_ahead_of_their_schedules_as_one_device(model_dir, t):
    """Greedy and seeded sampled requests over two ranks: the steps run ahead are used (the
    ranks' schedules hold them) and the tokens equal one device's (greedy) and the group's
    without async scheduling (sampled, seeded)."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB, lengths=(3, 17, 30, 9, 21))
    expected = _tokens(LLM(path, **ENGINE_KWARGS), prompts, GREEDY)
    llm = group_llm(path, t, async_scheduling=True)
    assert _tokens(llm, prompts, GREEDY) == expected
    group = llm.llm_engine.group.group_runner()
    assert group.ahead.num_used > 0
    sampled = [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(len(prompts))
    ]
    without = _tokens(group_llm(path, t), prompts, sampled)
    used = group.ahead.num_used
    assert _tokens(llm, prompts, sampled) == without
    assert group.ahead.num_used > used


def test_a_request_arriving_on_one_rank_drops_the_step_run_ahead(model_dir):
    """Requests arrive while the ranks decode: the group's step run ahead no longer holds the
    rank that got one, so it is dropped and the scheduled steps run; every request gives one
    device's tokens."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB, lengths=(6, 13, 9, 20, 4, 11))
    expected = _tokens(LLM(path, **ENGINE_KWARGS), prompts, GREEDY)
    llm = group_llm(path, async_scheduling=True)
    engine = llm.llm_engine
    assert run_with_arrivals(engine, prompts, (3, 5, 7, 9)) == expected
    group = engine.group.group_runner()
    assert group.ahead.num_used > 0
    assert group.ahead.num_dropped > 0
