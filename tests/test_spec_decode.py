"""Speculative decoding with n-gram drafts (speculative_config): greedy and seeded sampled
requests get exactly the tokens they get without speculation, while verified drafts give
several tokens a step."""

import collections
import math
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from conftest import SMOLLM2_ENGINE_KWARGS
from family_parity import TINY_SHAPES, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.core import (
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from jvllm.core.spec_decode import DraftProposer, accept_drafts
from jvllm.engine.arg_utils import EngineArgs
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.spec_decode.ngram import propose_ngram_drafts

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 8}
EOS = 2
PROMPTS = [
    [5, 90, 77, 120, 3, 5, 90, 77],
    list(range(100, 116)),
    [17],
    [(i * 79) % 500 + 3 for i in range(45)],
]


def ngram(k: int) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }


@pytest.fixture(scope="module")
def looping_model_dir(tmp_path_factory, smollm2_dir) -> str:
    """A tiny random Llama whose attention output is scaled down to a tenth: its greedy
    continuations fall into loops (drafts get accepted) that the context still breaks now
    and then (drafts get rejected), and it says EOS (id 2) after some prompts."""
    path = str(tmp_path_factory.mktemp("looping_llama"))
    config = transformers.LlamaConfig(
        **TINY_SHAPES, bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False
    )
    model = save_random_model(path, config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # for the stop string's text
        shutil.copy(os.path.join(smollm2_dir, name), path)
    return path


@pytest.fixture(scope="module")
def plain_llm(looping_model_dir) -> LLM:
    return LLM(looping_model_dir, **ENGINE_KWARGS)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def spec_llm(looping_model_dir) -> LLM:
    """k = 3 on the default KV cache, for the tests that need no other engine."""
    return LLM(looping_model_dir, speculative_config=ngram(3), **ENGINE_KWARGS)


def _step_runs(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each step gave one request, stepping the engine by hand."""
    engine = llm.llm_engine
    engine.add_request("runs", {"prompt_token_ids": prompt}, params)
    runs, seen = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = output.outputs[0].token_ids
            if len(token_ids) > seen:
                runs.append(list(token_ids[seen:]))
                seen = len(token_ids)
    return runs


def _inside_a_run(runs: list[list[int]]) -> tuple[int, int]:
    """(output index, token) of a token that a step gave before another one (an accepted
    draft, not the run's last token), at its first occurrence in the output."""
    output = [t for run in runs for t in run]
    at = 0
    for run in runs:
        for j, token in enumerate(run[:-1]):
            if output.index(token) == at + j:
                return at + j, token
        at += len(run)
    raise AssertionError(f"no accepted draft stands first in {runs}")


def test_ngram_drafts_follow_the_longest_earliest_match():
    tokens = np.array([1, 2, 3, 4, 1, 2, 3, 5, 6, 1, 2, 3])
    assert propose_ngram_drafts(tokens, 1, 4, 3) == [4, 1, 2]  # 3-gram [1 2 3], first at 0
    assert propose_ngram_drafts(tokens, 4, 4, 3) == []  # [6 1 2 3] never came before
    assert propose_ngram_drafts(tokens, 1, 1, 2) == [4, 1]  # 1-gram [3], first at 2
    assert propose_ngram_drafts(np.array([7, 8, 9, 7]), 1, 4, 5) == [8, 9, 7]
    assert propose_ngram_drafts(np.array([7, 8]), 1, 4, 5) == []


def test_drafts_accepted_while_they_equal_the_targets():
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all, then the bonus
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first disagreement's
    assert accept_drafts([5], [4, 8]) == [4]  # all rejected


def _scheduler_with_drafts(k: int) -> Scheduler:
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=1)
    return Scheduler(
        SchedulerConfig(max_model_len=256, max_num_batched_tokens=64),
        KVCacheManager(num_blocks=32, block_size=4),
        DraftProposer(config, max_model_len=256),
    )


def _decoding_request(eos_token_id: int | None) -> tuple[Scheduler, Request, SchedulerOutput]:
    """A request [1 2 3 1] that sampled 2, scheduled with its drafts [3 1 2] (after [1 2])."""
    scheduler = _scheduler_with_drafts(3)
    params = SamplingParams(temperature=0, max_tokens=8)
    request = Request("r", [1, 2, 3, 1], params, eos_token_id=eos_token_id)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": 2})
    output = scheduler.schedule()
    assert output.spec_token_ids == {"r": [3, 1, 2]}
    assert output.num_scheduled_tokens == {"r": 4}  # the last token and the drafts
    assert output.will_sample(request)
    return scheduler, request, output


def test_accepted_drafts_join_the_tokens_and_their_kv_counts():
    scheduler, request, output = _decoding_request(eos_token_id=None)
    scheduler.update_from_output(output, {"r": [3, 1, 2, 7]})  # all accepted, then 7
    assert request.output_token_ids == [2, 3, 1, 2, 7]
    assert request.num_computed_tokens == request.num_tokens - 1  # all but the bonus
    stats = scheduler.drafter.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 3)


def test_eos_inside_an_accepted_run_stops_there():
    scheduler, request, output = _decoding_request(eos_token_id=3)
    scheduler.update_from_output(output, {"r": [3, 1, 5]})  # drafts 3 and 1 accepted
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [2, 3]  # what followed EOS is dropped


def test_speculative_config_is_checked():
    assert EngineArgs(speculative_config=ngram(2)).speculative_config.num_speculative_tokens == 2
    defaults = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 1})
    assert defaults.speculative_config.prompt_lookup_max == 5
    bad = {
        "method must be one of \\('ngram', 'draft_model', 'eagle', 'eagle3', 'mtp'\\)": {
            **ngram(2),
            "method": "medusa",
        },
        "num_speculative_tokens must be an int >= 1": ngram(0),
        "prompt_lookup_max must be >= prompt_lookup_min": {**ngram(2), "prompt_lookup_min": 5},
        "keys \\['revision'\\] are not supported": {**ngram(2), "revision": "x"},
    }
    for message, value in bad.items():
        with pytest.raises(ValueError, match=message):
            EngineArgs(speculative_config=value)
    for other in ({"async_scheduling": True}, {"runner": "pooling"}):
        with pytest.raises(ValueError, match="speculative_config does not run with"):
            EngineArgs(speculative_config=ngram(2), **other)


# k = 5 runs in a KV cache too small for the batch: requests with drafts get preempted.
@pytest.mark.parametrize(
    ("k", "num_blocks"), [pytest.param(1, None, marks=pytest.mark.slow), (3, None), (5, 14)]
)
def test_greedy_tokens_equal_those_without_speculation(k, num_blocks, looping_model_dir, plain_llm):
    """A batch of greedy requests with seeded sampled, logprobs and penalties ones beside them,
    all drafting, and one whose drafts stop short of its min_tokens (EOS is banned below it),
    over chunked prefill; then again, on prefix-cache hits. A stop token id,
    max_tokens and a stop string are chosen inside an accepted run of their request run alone
    (in the batch the token budget may cut its drafts); another request meets EOS."""
    llm = LLM(
        looping_model_dir,
        speculative_config=ngram(k),
        num_gpu_blocks_override=num_blocks,
        **ENGINE_KWARGS,
    )
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # A prompt that holds the loop its continuation runs in: a draft copied from the prompt
    # can be a token's first occurrence in the output, where a stop on it must cut.
    looping = PROMPTS[1] + _tokens(plain_llm, [PROMPTS[1]], greedy)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    index, token = _inside_a_run(_step_runs(llm, looping, greedy))
    text = llm.get_tokenizer().decode([token])
    assert text.strip()
    params = [greedy] * len(PROMPTS) + [
        SamplingParams(temperature=0, max_tokens=40),  # meets EOS
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[token], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=index + 1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[text], ignore_eos=True),
        SamplingParams(temperature=1.5, top_k=40, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
    ]
    prompts = [*PROMPTS, PROMPTS[1]] + [looping] * 7
    want = _tokens(plain_llm, prompts, params)
    assert want[len(PROMPTS)][-1] == EOS
    for _ in range(2):  # the second time on prefix-cache hits
        assert _tokens(llm, prompts, params) == want
    stats = llm.llm_engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[0] < stats.num_drafts  # some all rejected
    assert (llm.llm_engine.scheduler.num_preemptions_total > 0) == (num_blocks is not None)


def test_default_model_repeating_text_matches_and_accepts(smollm2_llm):
    prompt = (
        "Repeat the list exactly.\nList: apple, pear, plum, fig, kiwi, lime, date.\n"
        "List: apple, pear, plum, fig, kiwi, lime, date.\nList:"
    )
    params = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(**SMOLLM2_ENGINE_KWARGS, speculative_config=ngram(3))
    assert _tokens(llm, [prompt], params) == _tokens(smollm2_llm, [prompt], params)
    assert llm.llm_engine.spec_decoding_stats.acceptance_rate > 0.5


def test_drafts_end_where_a_position_would_ban_other_tokens():
    """The step's bias row holds the bans of the request's next token: the drafts stop before
    a position whose min_tokens or multi-token bad word bans differ, and before the first its
    grammar rejects. Prompt [5 7 8 9 4] and output [5] propose [7 8 9]."""
    proposer = DraftProposer(SpeculativeConfig(3, 4, 1), max_model_len=256)

    def drafts(bad_words=(), grammar=None, **params) -> list[int]:
        params = SamplingParams(temperature=0.7, max_tokens=16, **params)
        request = Request("r", [5, 7, 8, 9, 4], params, eos_token_id=2)
        request.bad_words_token_ids = [list(w) for w in bad_words]
        request.structured_output = grammar
        request.append_output_token_ids(5)
        return proposer.drafts_for(request, token_budget=64)

    assert drafts(top_p=0.9, presence_penalty=1.0, logit_bias={5: 1.0}, logprobs=2) == [7, 8, 9]
    assert drafts(bad_words=[[7]], allowed_token_ids=[5, 7, 8, 9]) == [7, 8, 9]
    assert drafts(bad_words=[[8, 9]]) == [7]  # 9 is banned after 7 8
    assert drafts(bad_words=[[5, 7, 8]]) == []  # 8 is banned after 5 7
    assert drafts(min_tokens=3) == [7]  # EOS is banned at output positions 1 and 2 only
    assert drafts(min_tokens=3, ignore_eos=True) == [7, 8, 9]  # nothing to ban
    assert drafts(min_tokens=1) == [7, 8, 9]

    class TwoMoreTokens:  # a grammar that accepts two tokens more, whichever
        def num_valid(self, token_ids: list[int]) -> int:
            return min(len(token_ids), 2)

    assert drafts(grammar=TwoMoreTokens()) == [7, 8]


# Low enough that the tiny model's continuations still loop (drafts get accepted), high
# enough that seeds give different texts.
TEMPERATURE = 0.15


def _sampled(seed: int, **params) -> SamplingParams:
    return SamplingParams(
        **{"temperature": TEMPERATURE, "seed": seed, "ignore_eos": True, **params}
    )


def _loops(llm: LLM, prompt: list[int], seed: int) -> bool:
    """Whether a step gives the seeded request an accepted draft before its text leaves the
    loop: its 2nd to 4th tokens come in one step."""
    runs = _step_runs(llm, prompt, _sampled(seed, max_tokens=4))
    return len(runs) == 2


def _sampled_variants(loop: list[int]) -> list[SamplingParams]:
    """Seeded sampled requests through each stage of the sampler; `loop` the tokens the
    model's continuation repeats."""
    variants = [
        {},
        {"top_k": 3, "top_p": 0.9},
        {"min_p": 0.2},
        {"frequency_penalty": 0.5},  # counts the drafts before a position, not after
        {"presence_penalty": 0.3, "repetition_penalty": 1.2},
        {"logit_bias": {loop[0]: 0.3, loop[1]: -0.3}},
        {"allowed_token_ids": sorted({*loop, *range(3, 40)})},
        {"min_tokens": 2, "stop_token_ids": [loop[1]]},  # banned at the first 2 positions
        {"bad_words": [" the F"]},  # tokens 260 426: 426 banned after 260
        {"logprobs": 2},
    ]
    return [_sampled(seed, max_tokens=24, **variant) for variant in variants for seed in (1, 2)]


def test_seeded_sampled_tokens_and_logprobs_equal_those_without_speculation(
    looping_model_dir, plain_llm, spec_llm
):
    """Each draft position samples with the key, processors and filters of its output index,
    and a draft counts only where it equals that sample: the same text as one token a step.
    Stops inside an accepted run are found in the request run alone, as in the greedy test."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    looping = PROMPTS[1] + _tokens(plain_llm, [PROMPTS[1]], greedy)[0]
    params = _sampled_variants(looping[len(PROMPTS[1]) :])
    stats = spec_llm.llm_engine.spec_decoding_stats
    accepted = stats.num_accepted_tokens
    want = plain_llm.generate([looping] * len(params), params, use_tqdm=False)
    got = spec_llm.generate([looping] * len(params), params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [
        list(o.outputs[0].token_ids) for o in want
    ]
    assert stats.num_accepted_tokens > accepted
    assert len({tuple(o.outputs[0].token_ids) for o in want[:2]}) == 2  # the seeds matter
    for spec, plain in zip(got[-2:], want[-2:]):  # logprobs=2: those of every token
        spec_lps, plain_lps = spec.outputs[0].logprobs, plain.outputs[0].logprobs
        assert len(spec_lps) == len(plain_lps) == 24
        for spec_lp, plain_lp in zip(spec_lps, plain_lps):
            assert spec_lp.keys() == plain_lp.keys()
            for token_id, logprob in plain_lp.items():
                assert spec_lp[token_id].rank == logprob.rank
                assert abs(spec_lp[token_id].logprob - logprob.logprob) < 1e-4

    # The first seed whose text accepts drafts while it still loops.
    seed = next(seed for seed in range(3, 20) if _loops(spec_llm, looping, seed))
    index, token = _inside_a_run(_step_runs(spec_llm, looping, _sampled(seed, max_tokens=24)))
    stopping = [
        _sampled(seed, max_tokens=24, stop_token_ids=[token], ignore_eos=False),
        _sampled(seed, max_tokens=index + 1),
    ]
    want = _tokens(plain_llm, [looping] * 2, stopping)
    assert want[0][-1] == token and len(want[1]) == index + 1
    assert _tokens(spec_llm, [looping] * 2, stopping) == want


@pytest.mark.slow  # 400 requests: 6 s on 2 cores
def test_sampled_continuations_have_the_same_distribution_with_speculation(plain_llm, spec_llm):
    """Different seeds with and without speculation (so different draws): the 4-token
    continuations of a looping prompt fall alike, by a chi-square test of homogeneity."""
    num_runs = 200
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    looping = PROMPTS[1] + _tokens(plain_llm, [PROMPTS[1]], greedy)[0]
    stats = spec_llm.llm_engine.spec_decoding_stats
    accepted = stats.num_accepted_tokens
    texts = [
        _tokens(
            llm, [looping] * num_runs, [_sampled(first + i, max_tokens=4) for i in range(num_runs)]
        )
        for llm, first in ((plain_llm, 0), (spec_llm, num_runs))
    ]
    assert stats.num_accepted_tokens - accepted > num_runs  # runs of several tokens
    # Each text seen at least 10 times in all is a category, the others one more.
    seen = collections.Counter(tuple(t) for runs in texts for t in runs)
    common = [text for text, n in seen.items() if n >= 10]
    counts = np.array([[sum(tuple(t) == text for t in runs) for text in common] for runs in texts])
    counts = np.concatenate([counts, num_runs - counts.sum(1, keepdims=True)], axis=1)
    counts = counts[:, counts.sum(0) > 0]
    wanted = counts.sum(0) / 2  # [C] as many runs each
    chi2 = float(((counts - wanted) ** 2 / wanted).sum())
    dof = counts.shape[1] - 1
    assert dof >= 3, seen  # continuations vary
    assert chi2 < dof + 10 * math.sqrt(2 * dof), (chi2, counts)


def test_spec_decode_counters_reach_the_metrics(spec_llm):
    """vLLM's spec_decode_* counters on /metrics: the engine's, summed over its replicas."""
    from prometheus_client import generate_latest

    from jvllm.engine.async_llm import AsyncLLM
    from jvllm.engine.metrics import ServingMetrics

    llm = spec_llm
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([PROMPTS[1]], params, use_tqdm=False)
    stats = llm.llm_engine.spec_decoding_stats
    engine = AsyncLLM(llm.llm_engine)  # its first snapshot holds the counters so far
    try:
        scrape = generate_latest(ServingMetrics(engine, "m").registry).decode()
    finally:
        engine.shutdown()
    assert stats.num_accepted_tokens > 0
    drafts = f'jvllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {stats.num_draft_tokens}'
    assert drafts + ".0" in scrape
    first = stats.num_accepted_tokens_per_pos[0]
    assert f'per_pos_total{{model_name="m",position="0"}} {first}.0' in scrape


@pytest.mark.slow  # an adapter through PEFT and two engines: 40 s on 2 cores
def test_drafts_verified_by_lora_adapters_give_the_tokens_without_speculation(
    looping_model_dir, tmp_path
):
    """Each request's drafts checked against its own adapter's logits (q and v adapted: the
    looping model still loops, so drafts are accepted), beside a base-model request."""
    from test_lora import save_adapter

    from jvllm.lora.request import LoRARequest

    save_adapter(looping_model_dir, str(tmp_path), 1, r=8, target_modules=["q_proj", "v_proj"])
    adapter = LoRARequest("qv", 1, str(tmp_path))
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": ngram(3)})):
        llm = LLM(looping_model_dir, **ENGINE_KWARGS, **lora, **extra)
        got = llm.generate(PROMPTS, params, lora_request=[adapter, None] * 2, use_tqdm=False)
        outputs[name] = [list(o.outputs[0].token_ids) for o in got]
    assert outputs["spec"] == outputs["plain"]
    assert llm.llm_engine.scheduler.drafter.stats.num_accepted_tokens > 0
