"""Sampler plans (sample/plan.py): a step compiled for its plan samples what the batch-level
switches sample, holds no conditional, and the engine runs it once compiled."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RAGGED_PROMPTS as PROMPTS
from test_sampler import _metadata

from jvllm import LLM, SamplingParams
from jvllm.sample.plan import SAMPLER_PLANS_ENV, SamplerPlan, choose_plan, use_sampler_plans
from jvllm.sample.sampler import sample, sample_step
from jvllm.worker import step_compiler

_PLANNED = [SamplerPlan.GREEDY, SamplerPlan.RANDOM, SamplerPlan.FILTERED]


def _rows(plan: SamplerPlan, num_seqs: int) -> dict:
    """Per-row sampling fields of a batch whose plan is `plan`: FILTERED mixes greedy rows,
    rows without filters and rows whose filters need the bisection (top-k past the 256
    candidates, a top-p over a flat row)."""
    if plan is SamplerPlan.GREEDY:
        return {"temperature": np.zeros(num_seqs, np.float32), "all_greedy": np.bool_(True)}
    rows = {
        "temperature": np.array([0.0, 0.7, 1.0, 1.3, 0.5, 1.0], np.float32)[:num_seqs],
        "all_greedy": np.bool_(False),
        "any_filter": np.bool_(plan is SamplerPlan.FILTERED),
    }
    if plan is SamplerPlan.FILTERED:
        rows["top_k"] = np.array([0, 0, 300, 5, 0, 0], np.int32)[:num_seqs]
        rows["top_p"] = np.array([1.0, 1.0, 1.0, 0.9, 0.999, 0.8], np.float32)[:num_seqs]
        rows["min_p"] = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.1], np.float32)[:num_seqs]
    return rows


def _batch(plan: SamplerPlan, seed: int):
    rng = np.random.default_rng(seed)
    num_seqs, vocab = 6, 1000
    logits = rng.normal(size=(num_seqs, vocab)).astype(np.float32)
    logits[4] *= 0.01  # a flat row: its top-p reaches past the candidates
    md = dataclasses.replace(_metadata(num_seqs), **_rows(plan, num_seqs))
    md = dataclasses.replace(md, seeds=rng.integers(0, 2**32, num_seqs, dtype=np.uint32))
    return jnp.asarray(logits), md


@pytest.mark.parametrize("plan", _PLANNED, ids=lambda p: p.value)
def test_a_planned_sampler_draws_what_the_switches_draw(plan):
    for seed in range(5):
        logits, md = _batch(plan, seed)
        assert choose_plan(md) is plan
        planned = np.asarray(jax.jit(sample, static_argnums=2)(logits, md, plan))
        switched = np.asarray(jax.jit(sample)(logits, md))
        np.testing.assert_array_equal(planned, switched)


@pytest.mark.parametrize(
    "switch",
    ["any_penalties", "any_bias", "any_constrained", "any_logprobs", "any_prompt_logprobs"],
)
def test_any_stage_past_sampling_keeps_the_switches(switch):
    md = dataclasses.replace(_metadata(2), **{switch: np.bool_(True)})
    assert choose_plan(md) is SamplerPlan.DYNAMIC


def _lowered_text(plan: SamplerPlan) -> str:
    logits, md = _batch(SamplerPlan.FILTERED, 0)
    hidden = jnp.zeros((logits.shape[0], 4), jnp.float32)  # T = S: prompt_target_ids is [S]

    def step(logits, md, hidden):
        return sample_step(
            logits,
            hidden,
            md,
            bias_rows=jnp.zeros((1, logits.shape[1]), jnp.float32),
            token_cache=jnp.zeros((4, 16), jnp.int32),
            block_tables=jnp.zeros((logits.shape[0], 4), jnp.int32),
            seq_lens=jnp.ones(logits.shape[0], jnp.int32),
            logits_fn=lambda h: h @ jnp.ones((4, logits.shape[1]), jnp.float32),
            max_logprobs=5,
            plan=plan,
        )

    return jax.jit(step).lower(logits, md, hidden).as_text()


def test_a_planned_step_holds_no_conditional():
    """What a GPU waits on (XLA's conditional reads its predicate on the host); the bisection's
    loops have a fixed trip count."""
    assert "stablehlo.case" in _lowered_text(SamplerPlan.DYNAMIC)
    for plan in _PLANNED:
        text = _lowered_text(plan)
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, plan


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SAMPLER_PLANS_ENV}='yes'; allowed"):
        use_sampler_plans()
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "1")
    assert use_sampler_plans()
    monkeypatch.delenv(SAMPLER_PLANS_ENV)
    assert use_sampler_plans() == (jax.default_backend() == "gpu")


_ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 8}
# Greedy, temperature alone, and top-k (a few tokens near the 49152-wide random model's
# boundaries would make seeded samples of executables compiled apart flip now and then; see
# test_multi_step.py).
_PARAMS = {
    SamplerPlan.GREEDY: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplerPlan.RANDOM: SamplingParams(temperature=0.05, seed=7, max_tokens=12, ignore_eos=True),
    SamplerPlan.FILTERED: SamplingParams(
        temperature=1.0, top_k=40, seed=7, max_tokens=12, ignore_eos=True
    ),
}


@pytest.mark.parametrize("setting", [{}, {"num_scheduler_steps": 4}, {"async_scheduling": True}])
def test_the_engine_runs_each_plans_executable_once_compiled(
    tiny_llama_dir, monkeypatch, setting, background_compiles
):
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "0")
    switched = LLM(tiny_llama_dir, **_ENGINE_KWARGS, **setting)
    expected = {
        plan: switched.generate(PROMPTS, params, use_tqdm=False) for plan, params in _PARAMS.items()
    }
    del switched
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "1")

    def from_the_host(md):  # a plan read from device arrays would wait for the step before
        assert not isinstance(md.all_greedy, jax.Array)
        return choose_plan(md)

    monkeypatch.setattr(step_compiler, "choose_plan", from_the_host)
    llm = LLM(tiny_llama_dir, **_ENGINE_KWARGS, **setting)
    runner = llm.llm_engine.model_runner
    waited = []  # a step that runs a DYNAMIC executable gets it through `wait`
    wait = runner.compiler.executables.wait
    monkeypatch.setattr(
        runner.compiler.executables, "wait", lambda shape: waited.append(shape) or wait(shape)
    )
    for plan, params in _PARAMS.items():
        first = llm.generate(PROMPTS, params, use_tqdm=False)  # the plan's first steps
        runner.compiler.wait_for_compiles()
        waited.clear()
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        assert waited == [], plan
        for outputs in (first, again):
            tokens = [o.outputs[0].token_ids for o in outputs]
            assert tokens == [o.outputs[0].token_ids for o in expected[plan]], plan


def test_a_step_compiles_its_plans_executable_itself_in_lockstep(
    tiny_llama_dir, monkeypatch, background_compiles
):
    """With several processes nothing compiles in the background (each process must run the
    same executables); a step of a plan then compiles the plan's own, and where no DYNAMIC
    one is compiled either, only the plan's."""
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "1")
    llm = LLM(tiny_llama_dir, **_ENGINE_KWARGS)
    runner = llm.llm_engine.model_runner
    runner.compiler.executables.lockstep = True  # what jax.process_count() > 1 sets
    params = _PARAMS[SamplerPlan.GREEDY]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    plans = {plan for _, _, plan in runner.compiler.executables._ready}
    assert plans == {SamplerPlan.GREEDY}
    monkeypatch.setenv(SAMPLER_PLANS_ENV, "0")
    switched = LLM(tiny_llama_dir, **_ENGINE_KWARGS).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in switched]
