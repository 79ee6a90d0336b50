"""Compiling in background threads: requests are answered while other buckets compile."""

import threading
import time

import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.arg_utils import EngineArgs
from jvllm.sample.plan import SamplerPlan
from jvllm.worker.buckets import Bucket

pytestmark = pytest.mark.usefixtures("background_compiles")

_KWARGS = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32}
_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_SHORT, _LONG = [[5, 6, 7]], [list(range(10, 30))]  # need mixed buckets of 16 and 32 tokens


@pytest.fixture(scope="module")
def expected(tiny_llama_weights_dir):
    llm = LLM(tiny_llama_weights_dir, **_KWARGS)
    return [
        llm.generate(p, _PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in (_SHORT, _LONG)
    ]


def _engine_holding_back(model_dir, held: Bucket):
    """An LLM compiling every bucket in the background, where `held`'s compile blocks until the
    returned event is set."""
    llm = LLM(model_dir, **_KWARGS)
    runner = llm.llm_engine.model_runner
    release = threading.Event()
    compile_fn = runner.compiler.executables._compile_fn

    def held_back(shape):
        if shape == (held, "step", SamplerPlan.DYNAMIC):
            assert release.wait(120)
        return compile_fn(shape)

    runner.compiler.executables._compile_fn = held_back
    runner.compile_in_background()
    return llm, runner, release


def test_a_request_is_answered_while_a_bucket_it_does_not_need_compiles(
    tiny_llama_weights_dir, expected
):
    held = Bucket(32, 4, 16)  # the largest mixed bucket
    llm, runner, release = _engine_holding_back(tiny_llama_weights_dir, held)
    try:
        short = llm.generate(_SHORT, _PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert not runner.compiler.is_ready(held, "step")  # still compiling
        assert short == expected[0]
        # A prompt that only the held bucket holds waits for that compile alone.
        threading.Timer(0.5, release.set).start()
        long = llm.generate(_LONG, _PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert long == expected[1]
    finally:
        release.set()
    runner.compiler.wait_for_compiles()
    assert runner.compiler.num_compilations == len(runner.compiler.all_shapes())


def test_a_step_runs_in_a_larger_compiled_bucket_while_its_own_compiles(
    tiny_llama_weights_dir, expected
):
    held = Bucket(1, 1, 1)  # the one-sequence decode bucket
    llm, runner, release = _engine_holding_back(tiny_llama_weights_dir, held)
    try:
        # Every decode step of the lone sequence runs in a larger bucket meanwhile.
        short = llm.generate(_SHORT, _PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert not runner.compiler.is_ready(held, "step")
        assert short == expected[0]
    finally:
        release.set()
    runner.compiler.wait_for_compiles()
    assert runner.compiler.is_ready(held, "step")


def test_a_bucket_lent_to_a_step_gets_no_sampler_plan(
    tiny_llama_weights_dir, expected, monkeypatch
):
    """A plan's executables are for the step's own bucket: a larger one that runs the step
    while its own compiles runs the switches, and no plan compiles for it."""
    monkeypatch.setenv("JVLLM_SAMPLER_PLANS", "1")
    held = Bucket(1, 1, 1)
    llm, runner, release = _engine_holding_back(tiny_llama_weights_dir, held)
    try:
        # Every other shape compiled first, so that the decode steps run in a lent bucket.
        deadline = time.monotonic() + 120
        while len(runner.compiler.executables) < len(runner.compiler.all_shapes()) - 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        short = llm.generate(_SHORT, _PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert short == expected[0]
    finally:
        release.set()
    runner.compiler.wait_for_compiles()
    planned = [s for s in runner.compiler.executables._ready if s[2] is not SamplerPlan.DYNAMIC]
    assert planned and all(not b.is_decode for b, _, _ in planned)


@pytest.mark.parametrize("name", ["compile_all_buckets", "compile_in_background"])
def test_compile_options_take_bools_only(name):
    with pytest.raises(ValueError, match=f"{name} must be a bool, got 'yes'"):
        EngineArgs(**{name: "yes"})
