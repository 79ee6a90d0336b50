"""Decode windows (`num_scheduler_steps=k`) and async scheduling: the same tokens, logprobs and
finishes as single synchronous steps."""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import RAGGED_PROMPTS as PROMPTS

from jvllm import LLM, LLMEngine, SamplingParams
from jvllm.worker.decode_loop import WINDOW_STEPS_PER_CHECK_ENV

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 8}
# Seeded samples compare across executables compiled apart, whose float32 logits can differ in
# the last bits. The random tiny model's distribution is near uniform over 49152 tokens, so
# the inverse-CDF sampler's u lands within such a difference of a token boundary often enough
# to flip a sample now and then (once in a full run, 23088 against 23086). A top-k keeps the
# seeded keys under test while leaving few boundaries to land near.
SEEDED_TOP_K = 40


@pytest.fixture
def engines(tiny_llama_dir):
    """One LLM per k on the tiny model, made on first use. Per test, not per module: a dozen
    live engines (1100 memory maps each, more with Pallas in interpret mode) took a whole run
    of the suite past vm.max_map_count; the XLA cache makes the next test's engines cheap."""
    made = {}

    def get(k: int | str, model: str = tiny_llama_dir, **kwargs) -> LLM:
        """k: decode steps per call, or "async" (single steps, each run ahead)."""
        if k == "async":
            k, kwargs = 1, {**kwargs, "async_scheduling": True}
        key = (k, model, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = LLM(model, num_scheduler_steps=k, **ENGINE_KWARGS, **kwargs)
        return made[key]

    return get


class _Summary(list):
    """Everything the outputs of a generate say, per sample, for comparisons across settings.

    Logprobs compare to 1e-4: a window's loop body is compiled apart from the single step, and
    its float32 logits can differ in the last bits (1.7e-6 in a logprob, seen once)."""

    def __init__(self, outputs):
        super().__init__(
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, _ranks(c.logprobs))
            for o in outputs
            for c in o.outputs
        )
        self.values = [v for o in outputs for c in o.outputs for v in _logprob_values(c)]

    def __eq__(self, other):
        return (
            list(self) == list(other)
            and len(self.values) == len(other.values)
            and bool(np.allclose(self.values, other.values, atol=1e-4))
        )


def _ranks(logprobs):
    return None if logprobs is None else [{t: lp.rank for t, lp in e.items()} for e in logprobs]


def _logprob_values(c) -> list[float]:
    values = [lp.logprob for e in c.logprobs or [] for lp in e.values()]
    return values + ([] if c.cumulative_logprob is None else [c.cumulative_logprob])


def _generate(llm: LLM, params, prompts=PROMPTS) -> _Summary:
    """`_summary` of a generate from an empty prefix cache: engines with other histories would
    take other hits, whose logprobs differ in the last bits."""
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert manager.reset_prefix_cache()
    outputs = _Summary(llm.generate(prompts, params, use_tqdm=False))
    assert manager.num_free_blocks == manager.num_usable_blocks  # every block came back
    return outputs


@pytest.mark.parametrize("k", [2, 4, pytest.param(16, marks=pytest.mark.slow), "async"])
def test_greedy_and_seeded_sampling_match_single_steps(engines, k):
    greedy = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=19, ignore_eos=True
    )
    for params in (greedy, seeded):
        assert _generate(engines(k), params) == _generate(engines(1), params)


def test_stops_inside_a_window_match_single_steps(engines):
    """Stop token ids, stop strings and max_tokens that fall mid-window, min_tokens that holds
    stops back, penalties, logit bias and logprobs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = engines(1).generate(PROMPTS, greedy, use_tqdm=False)
    # Ids and text that the free runs produce after their 7th token: windows of 4 start at
    # tokens 2, 6, 10 (the prefill samples the first).
    stop_ids = [o.outputs[0].token_ids[6] for o in free[:3]]
    stop_text = free[3].outputs[0].text[len(free[3].outputs[0].text) // 3 :][:3]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text], ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=30, stop=[stop_text], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0.0, max_tokens=13, min_tokens=9, stop_token_ids=stop_ids),
        SamplingParams(
            temperature=1.0,
            top_k=SEEDED_TOP_K,
            seed=11,
            max_tokens=22,
            presence_penalty=0.8,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            logit_bias={stop_ids[0]: 4.0, 500: -100.0},
            logprobs=3,
        ),
        SamplingParams(temperature=0.0, max_tokens=17, logprobs=2, bad_words=["the cat"]),
    ]
    for params in cases:
        expected = _generate(engines(1), params)
        for k in (4, 16, "async"):
            assert _generate(engines(k), params) == expected
    staggered = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, stop_token_ids=stop_ids)
        for n in (3, 30, 9, 14, 21)
    ]
    expected = _generate(engines(1), staggered)
    for k in (4, "async"):
        assert _generate(engines(k), staggered) == expected
    by_id, by_text = _generate(engines(4), cases[0]), _generate(engines(4), cases[1])
    assert any(c[3] == "stop" and len(c[1]) <= 7 for c in by_id)
    assert any(c[4] == stop_text for c in by_text)


@pytest.mark.slow  # 15-22 s; test_spec_decode_window.py checks rounds every few in the default run
def test_stops_checked_every_few_steps_match_single_steps(engines, tiny_llama_dir, monkeypatch):
    """A window that checks for stopped rows after every 3 steps (so a run of steps passes
    the window's end when 3 does not divide k, and steps run after every row has stopped)
    samples, stops and frees as single steps do."""
    monkeypatch.setenv(WINDOW_STEPS_PER_CHECK_ENV, "3")
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = engines(1).generate(PROMPTS, greedy, use_tqdm=False)
    stop_ids = [o.outputs[0].token_ids[4] for o in free[:3]]
    staggered = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, stop_token_ids=stop_ids)
        for n in (3, 30, 9, 14, 21)
    ]
    seeded = SamplingParams(
        temperature=1.0,
        top_k=SEEDED_TOP_K,
        seed=3,
        max_tokens=17,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    for k in (4, 16):
        checked = LLM(tiny_llama_dir, num_scheduler_steps=k, **ENGINE_KWARGS)
        for params in (staggered, seeded):
            assert _generate(checked, params) == _generate(engines(1), params)
    # The runs of 3 steps are loops XLA knows the trip count of, which read no predicate.
    runner = checked.llm_engine.model_runner
    used = [s for s in runner.compiler.executables._ready if s[1] == "window"]
    assert used and all(
        '"known_trip_count":{"n":"3"}' in runner.compiler.executables.get(s).as_text() for s in used
    )


@pytest.fixture
def eos_model_dir(tmp_path_factory, tiny_llama_dir, engines):
    """The tiny model with its EOS id set to a token its greedy runs produce mid-way."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = engines(1).generate(PROMPTS[1:2], greedy, use_tqdm=False)[0].outputs[0].token_ids
    path = str(tmp_path_factory.mktemp("tiny_eos"))
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = out[6]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.slow  # EOS is one of a window's stop ids (test_stops_inside_a_window_match_...)
def test_eos_inside_a_window_matches_single_steps(engines, eos_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = _generate(engines(1, eos_model_dir), params)
    assert any(c[3] == "stop" for c in expected)
    assert _generate(engines(4, eos_model_dir), params) == expected
    assert _generate(engines("async", eos_model_dir), params) == expected


def test_parallel_samples_and_prefix_hits_match_single_steps(engines):
    params = SamplingParams(
        n=3, temperature=1.0, top_k=SEEDED_TOP_K, seed=5, max_tokens=15, ignore_eos=True
    )
    shared = [(i * 31) % 30000 + 500 for i in range(40)]
    prompts = [shared + [11, 12], shared + [13, 14, 15]]
    expected = _generate(engines(1), params, prompts)
    for k in (4, "async"):
        engines(k).llm_engine.scheduler.kv_cache_manager.reset_prefix_cache()
        windowed = engines(k).generate(prompts, params, use_tqdm=False)
        assert _Summary(windowed) == expected
        assert windowed[1].num_cached_tokens == 32


def _step_engine(engine: LLMEngine, script: dict[int, callable]) -> dict[str, list[int]]:
    """Step until done, running script[i] before step i; -> each request's final tokens."""
    tokens, i = {}, 0
    while engine.has_unfinished_requests() or i in script:
        if i in script:
            script[i](engine)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        i += 1
    return tokens


def test_aborts_and_arrivals_between_windows_match_single_steps(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for k, run_ahead in ((1, False), (4, False), (1, True), (4, True)):
        engine = LLMEngine(
            tiny_llama_dir, num_scheduler_steps=k, async_scheduling=run_ahead, **ENGINE_KWARGS
        )
        script = {
            0: lambda e: [e.add_request(f"a{i}", p, params) for i, p in enumerate(PROMPTS[:3])],
            3: lambda e: e.abort_request("a1"),
            4: lambda e: e.add_request("late", PROMPTS[4], params),
            6: lambda e: e.add_request("later", PROMPTS[3], params),
        }
        results[k, run_ahead] = _step_engine(engine, script)
        manager = engine.scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_usable_blocks
    # The abort lands after a different number of tokens; the others are untouched by it.
    assert results[1, False].keys() == {"a0", "a2", "late", "later"}
    for key in ((4, False), (1, True), (4, True)):
        assert results[key] == results[1, False]


def test_forced_preemption_matches_single_steps(engines):
    """A KV pool too small for every request: windows fall back to single steps when short of
    blocks, and preempted requests resume with the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    small = {"block_size": 4, "num_gpu_blocks_override": 24}
    expected = _generate(engines(1, **small), params)
    for k in (4, "async"):
        llm = engines(k, **small)
        assert _generate(llm, params) == expected
        assert llm.llm_engine.scheduler.num_preemptions_total > 0


@pytest.mark.slow  # two engines compile every bucket up front: a minute on 2 cores
def test_a_quantized_cache_rides_through_windows_async_steps_and_preemption(engines):
    """kv_cache_dtype="fp8" makes the KV cache a pair of arrays (values, scales), which the
    windows' loop and the steps run ahead carry and donate as they do the one array."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Every shape compiled up front, in both engines: a step whose bucket is still compiling
    # runs in a larger one, whose float32 sums differ in the last bits, and one-byte values
    # can round those apart into another token (2 of 4 slow runs of the suite). The async
    # engine also runs a step ahead only once that shape is compiled (see
    # test_async_scheduling_uses_the_steps_...).
    small = {
        "block_size": 4,
        "num_gpu_blocks_override": 24,
        "kv_cache_dtype": "fp8",
        "compile_all_buckets": True,
    }
    expected = _generate(engines(1, **small), params)
    llm = engines(4, async_scheduling=True, **small)
    assert _generate(llm, params) == expected
    runner = llm.llm_engine.model_runner
    assert runner.num_steps_ahead_used > 0 and llm.llm_engine.scheduler.num_preemptions_total > 0


def test_windows_run_fewer_device_calls_and_compile_a_bounded_set(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir,
        num_scheduler_steps=8,
        async_scheduling=True,
        compile_all_buckets=True,
        **ENGINE_KWARGS,
    )
    runner = llm.llm_engine.model_runner
    decode_buckets = [b for b in runner.buckets.all_buckets() if b.is_decode]
    compiled = runner.compiler.num_compilations
    # Each decode bucket also as a window and as a step run ahead.
    assert compiled == len(runner.buckets.all_buckets()) + 2 * len(decode_buckets)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=33, ignore_eos=True))
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    assert num_steps == 1 + 4  # the prefill samples one token, then 4 windows of 8
    assert runner.compiler.num_compilations == compiled  # nothing compiled on the hot path


def test_pallas_backend_windows_match_reference_single_steps(tiny_llama_weights_dir, engines):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = _generate(engines(1, tiny_llama_weights_dir), params, PROMPTS[:3])
    for k in (4, "async"):
        pallas = engines(k, tiny_llama_weights_dir, attention_backend="pallas")
        assert _generate(pallas, params, PROMPTS[:3]) == expected


def test_async_scheduling_uses_the_steps_it_ran_ahead(engines):
    # A step runs ahead only once its "ahead" executable is compiled: compile every shape up
    # front, or a slow machine uses fewer of the steps (19 of 20 seen in CI; 16 of 20 in the
    # staggered run below, whose last request runs alone in the 1-row bucket).
    llm = engines("async", compile_all_buckets=True)
    runner = llm.llm_engine.model_runner
    used, dropped = runner.num_steps_ahead_used, runner.num_steps_ahead_dropped
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    # 29 decode steps after the prefill; the runs ahead into a new block or past the end drop.
    assert runner.num_steps_ahead_used - used >= 20
    assert runner.num_steps_ahead_dropped - dropped <= 5
    # Requests that finish one after another leave the others' rows run ahead usable.
    used, dropped = runner.num_steps_ahead_used, runner.num_steps_ahead_dropped
    staggered = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 13, 20, 30)
    ]
    llm.generate(PROMPTS, staggered, use_tqdm=False)
    assert runner.num_steps_ahead_used - used >= 20
    assert runner.num_steps_ahead_dropped - dropped <= 5
