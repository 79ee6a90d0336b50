"""Windows of speculative rounds (`num_scheduler_steps` > 1 with a draft model or head, or
n-gram drafts, worker/spec_window.py): several rounds of drafting and verification in one
device call give the tokens of no speculation (greedy float32 and seeded sampled alike), stop
inside a run at EOS, a stop token id, max_tokens or min_tokens' end, and run in fewer engine
steps.
"""

import dataclasses

import pytest
import test_spec_decode as ngram_tests
import test_spec_decode_draft_model as draft_tests
import test_spec_decode_eagle as eagle_tests

from jvllm import LLM, SamplingParams

ENGINE_KWARGS, PROMPTS = ngram_tests.ENGINE_KWARGS, ngram_tests.PROMPTS
draft_model, eagle3 = draft_tests.draft_model, eagle_tests.eagle3
# The fixtures: a tiny random Llama that loops and says EOS, it plain, a one-layer draft that
# rarely agrees with it, and a random EAGLE-3 head.
looping_model_dir, plain_llm = ngram_tests.looping_model_dir, ngram_tests.plain_llm
other_draft_dir, head = draft_tests.other_draft_dir, eagle_tests.head


def _windows(target: str, draft: str) -> LLM:
    """The target with `draft` as its draft model, in windows of 4 rounds of k = 3."""
    return LLM(
        target, speculative_config=draft_model(draft), num_scheduler_steps=4, **ENGINE_KWARGS
    )


def _batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests to their EOS or max_tokens, one ending at a stop token id and one held to
    min_tokens, a seeded sampled one, and one that asks for logprobs."""
    greedy = SamplingParams(temperature=0, max_tokens=30)
    seeded = SamplingParams(temperature=1.2, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
    return [*PROMPTS, PROMPTS[1], PROMPTS[0], PROMPTS[2]], [
        *[greedy] * len(PROMPTS),
        seeded,
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[77, 5], min_tokens=3),
        SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True),
    ]


def _outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str, list[dict]]]:
    """Each output's tokens, finish reason and logprobs ({token id: (rank, logprob)} a token)."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = lambda steps: [
        {t: (lp.rank, lp.logprob) for t, lp in step.items()} for step in steps or ()
    ]
    return [
        (list(o.outputs[0].token_ids), o.outputs[0].finish_reason, logprobs(o.outputs[0].logprobs))
        for o in outputs
    ]


def _assert_same(got, want) -> None:
    """The same tokens, finish reasons, logprob ranks and ids; logprobs to 1e-4 (a verification
    step's matmuls round differently from a one-token step's)."""
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for (_, _, got_steps), (_, _, want_steps) in zip(got, want):
        assert len(got_steps) == len(want_steps)
        for got_lp, want_lp in zip(got_steps, want_steps):
            assert got_lp.keys() == want_lp.keys()
            for token, (rank, logprob) in want_lp.items():
                assert got_lp[token][0] == rank
                assert abs(got_lp[token][1] - logprob) < 1e-4


@pytest.mark.parametrize("agrees", [True, False])
def test_draft_model_windows_give_the_tokens_of_no_speculation(
    agrees, looping_model_dir, plain_llm, other_draft_dir
):
    draft = looping_model_dir if agrees else other_draft_dir
    llm = _windows(looping_model_dir, draft)
    prompts, params = _batch()
    _assert_same(_outputs(llm, prompts, params), _outputs(plain_llm, prompts, params))
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 30


def test_rounds_checked_every_few_give_the_tokens_of_no_speculation(
    monkeypatch, looping_model_dir, plain_llm, other_draft_dir
):
    """JVLLM_WINDOW_STEPS_PER_CHECK=3 with windows of 4 rounds: checks after rounds 3 and 6,
    the rounds past the fourth keeping every row stopped and writing nothing out (a draft that
    rarely agrees leaves rows short of their limits there)."""
    prompts, params = _batch()
    rounds = []
    for per_check in ("1", "3"):
        monkeypatch.setenv("JVLLM_WINDOW_STEPS_PER_CHECK", per_check)
        llm = _windows(looping_model_dir, other_draft_dir)
        _assert_same(_outputs(llm, prompts, params), _outputs(plain_llm, prompts, params))
        rounds.append(llm.llm_engine.spec_decoding_stats.num_drafts)
    assert rounds[0] == rounds[1] > 30  # every round's tokens came back


@pytest.mark.parametrize("max_tokens", [33, 19])
def test_a_window_runs_its_rounds_in_one_engine_step(max_tokens, looping_model_dir):
    """The target drafting for itself: each round keeps all k = 3 drafts and the bonus, so a
    window of 4 rounds gives 16 tokens. With 2 tokens left the last window's first round has
    one draft of the request's own (padded to 3 for the device), and the counters count that
    one: every draft counted is accepted. The request asks for logprobs, which a window returns
    for every token."""
    llm = _windows(looping_model_dir, looping_model_dir)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    engine.add_request("r", PROMPTS[1], params)
    sizes = []
    while engine.has_unfinished_requests():
        before = engine.scheduler.requests["r"].num_output_tokens
        engine.step()
        request = engine.scheduler.requests.get("r")
        sizes.append((request.num_output_tokens if request else max_tokens) - before)
    assert sizes == [1, 16, max_tokens - 17]  # the prefill's token, then two windows
    stats = engine.spec_decoding_stats
    assert stats.num_draft_tokens > 12
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("method", ["draft_model", pytest.param("ngram", marks=pytest.mark.slow)])
def test_windows_count_drafts_as_one_round_a_step_does(method, looping_model_dir):
    """Near max_tokens a window's later rounds verify k drafts where a step's scheduler would
    have proposed only those the request had room for: the counters count those (here, 27
    tokens in rounds of 4 leave the last round of the last window room for one draft), so
    the acceptance rate is the same with windows and without."""
    spec = draft_model(looping_model_dir) if method == "draft_model" else ngram_tests.ngram(3)
    params = SamplingParams(temperature=0, max_tokens=27, ignore_eos=True)
    counts = []
    for num_steps in (1, 4):
        llm = LLM(
            looping_model_dir,
            speculative_config=spec,
            num_scheduler_steps=num_steps,
            **ENGINE_KWARGS,
        )
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
        counts.append(dataclasses.astuple(llm.llm_engine.spec_decoding_stats))
    assert counts[0] == counts[1]
    assert counts[0][1] > 12  # drafts were proposed


@pytest.mark.slow  # 50 s cold; windows with a draft model and EAGLE-3 alone stay in the default run
def test_eagle3_windows_give_the_tokens_of_no_speculation(looping_model_dir, plain_llm, head):
    llm = LLM(
        looping_model_dir,
        speculative_config=eagle3(head[0]),
        num_scheduler_steps=3,
        num_gpu_blocks_override=14,
        **ENGINE_KWARGS,
    )
    prompts, params = _batch()
    _assert_same(_outputs(llm, prompts, params), _outputs(plain_llm, prompts, params))
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 30
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_rows_after_stopped_ones_read_their_pages_on_the_pure_jax_path(
    monkeypatch, looping_model_dir, plain_llm
):
    """Without the CPU kernel the page walk reads only the leading tiles that read pages: the
    two rows that stop in the first round must not push the fifth row's tiles past them."""
    monkeypatch.setenv("JVLLM_CPU_DECODE_KERNEL", "0")
    llm = _windows(looping_model_dir, looping_model_dir)
    prompts = [[5, 90, 77], [17, 3], PROMPTS[3][:12], PROMPTS[1], [40, 41, 42, 43]]
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [short, short, long, long, long]
    _assert_same(_outputs(llm, prompts, params), _outputs(plain_llm, prompts, params))


def test_a_row_that_stops_early_keeps_the_drafts_of_its_last_round(looping_model_dir):
    """The target drafting for itself: "a" stops at min_tokens after the first round (one whole
    run), "b" goes on for three more; the drafts "a" starts its next window with are those its
    own last round proposed, not those of the rounds it sat out on the null page, so every
    draft is accepted."""
    llm = _windows(looping_model_dir, looping_model_dir)
    engine = llm.llm_engine
    held = SamplingParams(temperature=0, min_tokens=5, max_tokens=21, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], held)
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=33))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.spec_decoding_stats
    assert stats.num_draft_tokens > 20
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_ngram_windows_look_their_drafts_up_on_the_device(looping_model_dir, plain_llm):
    """n-gram drafts in windows: the first round's from the host, the later rounds' looked up
    on the device (spec_decode/ngram_device.py) with the host's rule. The tokens are those of
    no speculation, and the later rounds of a looping request verify drafts and accept them."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(looping_model_dir, speculative_config=ngram, num_scheduler_steps=4, **ENGINE_KWARGS)
    prompts, params = _batch()
    _assert_same(_outputs(llm, prompts, params), _outputs(plain_llm, prompts, params))
    scheduler = llm.llm_engine.scheduler
    later = []  # (proposed, accepted) of each window's rounds after its first
    update = scheduler.update_from_output

    def keep_rounds(scheduler_output, sampled, round_drafts=None):
        later.extend(pair for rounds in (round_drafts or {}).values() for pair in rounds[1:])
        return update(scheduler_output, sampled, round_drafts)

    scheduler.update_from_output = keep_rounds
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # It loops: 118, 487, 118, 487, ...
    [output] = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    [want] = plain_llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert output.outputs[0].token_ids == want.outputs[0].token_ids
    assert sum(accepted for proposed, accepted in later if proposed) >= 12
