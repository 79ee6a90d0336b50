"""n-gram drafts in windows of speculative rounds (worker/spec_window.py) equal the host's rule
(spec_decode/ngram.py) over each request's tokens at every round after the first, read back
from the rounds each window reports: on a tiny Llama, and on a model whose every layer is
windowed, whose KV groups would free the pages a window passed (core/kv_groups.py)."""

import itertools

import numpy as np
import pytest
import test_kv_groups as kv_tests
import test_spec_decode as ngram_tests

from jvllm import LLM, SamplingParams
from jvllm.spec_decode.ngram import propose_ngram_drafts

looping_model_dir, mistral = ngram_tests.looping_model_dir, kv_tests.mistral
K, MIN_N, MAX_N = 3, 1, 3


def _later_rounds_against_the_host(llm: LLM, prompts) -> tuple[int, int]:
    """Generate, checking each later round's count of drafts against the host's rule over the
    request's tokens before it -> (rounds checked, drafts proposed in them)."""
    scheduler = llm.llm_engine.scheduler
    update, checked = scheduler.update_from_output, [0, 0]

    def check(scheduler_output, sampled, round_drafts=None):
        for request_id, rounds in (round_drafts or {}).items():
            request = scheduler.requests[request_id]
            history, tokens = list(request.all_token_ids), list(sampled[request_id])
            for (_, accepted), (proposed, _) in itertools.pairwise(rounds):
                history += tokens[: accepted + 1]
                del tokens[: accepted + 1]
                want = propose_ngram_drafts(np.asarray(history), MIN_N, MAX_N, K)
                assert proposed == len(want), (request_id, len(history))
                checked[0] += 1
                checked[1] += proposed
        return update(scheduler_output, sampled, round_drafts)

    scheduler.update_from_output = check
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return tuple(checked)


def _ngram_windows(path: str, **kwargs) -> LLM:
    spec = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": MIN_N,
        "prompt_lookup_max": MAX_N,
    }
    return LLM(path, speculative_config=spec, num_scheduler_steps=4, dtype="float32", **kwargs)


def test_later_rounds_propose_the_hosts_drafts(looping_model_dir):
    llm = _ngram_windows(looping_model_dir, max_num_batched_tokens=64, max_num_seqs=8)
    num_rounds, num_drafts = _later_rounds_against_the_host(llm, ngram_tests.PROMPTS)
    assert num_rounds > 20 and num_drafts > 20


@pytest.mark.parametrize("disable", [False, True])
def test_an_all_windowed_model_keeps_the_history_the_rounds_look_up(mistral, disable):
    """Mistral v0.1's kind (every layer windowed, W = 8 over pages of 4): the rounds read each
    request's tokens through its table, so no page may be freed behind the window."""
    llm = _ngram_windows(
        mistral[0], block_size=4, max_model_len=256, disable_hybrid_kv_cache_manager=disable
    )
    num_rounds, num_drafts = _later_rounds_against_the_host(llm, kv_tests._long_prompts())
    assert num_rounds > 20 and num_drafts > 20
