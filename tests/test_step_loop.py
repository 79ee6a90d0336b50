"""jvllm.step_loop: the engine's decode step in a caller's jitted loop gives LLM.generate's tokens."""

import jax
import jax.numpy as jnp
import pytest
from conftest import RAGGED_PROMPTS as PROMPTS

from jvllm import LLM, SamplingParams
from jvllm.step_loop import StepLoop


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
        long_prefill_token_threshold=12,
    )


def _run_loop(llm: LLM, params, num_steps: int, steps_per_call: int, choose=None):
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, params)

    @loop.jit
    def call(state):
        def body(i, carry):
            state, tokens, active = carry
            state, out = loop.step(state, choose)
            return state, tokens.at[i].set(out.token_ids), active.at[i].set(out.active)

        shape = (steps_per_call, state.stops.limits.shape[0])
        init = (state, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))
        return jax.lax.fori_loop(0, steps_per_call, body, init)

    tokens, active = [], []
    for _ in range(num_steps // steps_per_call):
        state, t, a = call(state)
        tokens.append(t)
        active.append(a)
    return loop.finish(state, jnp.concatenate(tokens), jnp.concatenate(active))


def _generate(llm: LLM, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("steps_per_call", [1, 8])
def test_loop_gives_generates_tokens_greedy_and_seeded(llm, steps_per_call):
    manager = llm.llm_engine.scheduler.kv_cache_manager
    greedy = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    free = _generate(llm, greedy)
    stop_id = free[2][9]  # request 2 stops at its 10th token, the others run to max_tokens
    cases = [
        SamplingParams(temperature=0.0, max_tokens=25, stop_token_ids=[stop_id]),
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=40,  # few token boundaries for last-bit logit differences to move u across
            seed=3,
            max_tokens=21,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias={stop_id: 3.0},
            ignore_eos=True,
        ),
    ]
    for params in cases:
        assert _run_loop(llm, params, 24, steps_per_call) == _generate(llm, params)
        assert manager.num_free_blocks == manager.num_usable_blocks
        assert not llm.llm_engine.has_unfinished_requests()
    assert len(_run_loop(llm, cases[0], 24, steps_per_call)[2]) == 10


def test_a_loop_can_choose_its_own_tokens(llm):
    """Tokens a caller chooses are fed back and stop rows like sampled ones; the logits handed
    out are the ones greedy sampling takes the argmax of."""
    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    argmax = lambda logits, out: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    assert _run_loop(llm, greedy, 16, 4, argmax) == _generate(llm, greedy)
    constant = lambda logits, out: jnp.full_like(out.sampled_token_ids, 42)
    stopping = SamplingParams(temperature=0.0, max_tokens=17, stop_token_ids=[42])
    # Each row's prefill tokens (greedy; short prompts decode while long ones prefill), then
    # the loop's one chosen token, which stops it.
    for ids, free in zip(_run_loop(llm, stopping, 8, 4, constant), _generate(llm, greedy)):
        assert ids[-1] == 42 and ids[:-1] == free[: len(ids) - 1]


def test_unsupported_requests_are_refused_and_leave_the_engine_idle(llm):
    manager = llm.llm_engine.scheduler.kv_cache_manager
    for params, named in [
        (SamplingParams(max_tokens=5, stop=["x"]), "stop"),
        (SamplingParams(max_tokens=5, min_tokens=2), "min_tokens"),
        (SamplingParams(max_tokens=5, n=2), "n"),
    ]:
        with pytest.raises(ValueError, match=named):
            StepLoop(llm).prefill(PROMPTS, params)
    with pytest.raises(ValueError, match="bad_words"):
        StepLoop(llm).prefill(PROMPTS, SamplingParams(max_tokens=5, bad_words=["the cat"]))
    with pytest.raises(ValueError, match="max_model_len"):  # the last prompt is too long
        StepLoop(llm).prefill(PROMPTS + [list(range(100, 300))], SamplingParams(max_tokens=5))
    assert not llm.llm_engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_only_the_first_call_of_a_jitted_loop_compiles(llm):
    """The state prefill returns is laid out as a jitted call returns it."""
    lowerings = []
    count = lambda event, duration, **kwargs: lowerings.append(event)
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    call = loop.jit(loop.step)
    per_call, tokens, active = [], [], []
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for _ in range(3):
            before = lowerings.count(LOWERING)
            state, out = call(state)
            per_call.append(lowerings.count(LOWERING) - before)
            tokens.append(out.token_ids)
            active.append(out.active)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    loop.finish(state, jnp.stack(tokens), jnp.stack(active))
    assert per_call[0] >= 1 and per_call[1:] == [0, 0]


LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def test_a_held_engine_refuses_requests_and_a_donated_state_is_refused(llm):
    manager = llm.llm_engine.scheduler.kv_cache_manager
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = _generate(llm, greedy)
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, greedy)
    with pytest.raises(RuntimeError, match="finish the loop"):
        llm.generate(PROMPTS, greedy, use_tqdm=False)
    call = loop.jit(loop.step)
    new_state, out = call(state)
    with pytest.raises(ValueError, match="donated"):
        loop.finish(state, out.token_ids[None], out.active[None])
    loop.finish(new_state, out.token_ids[None], out.active[None])
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert _generate(llm, greedy) == expected


def test_a_failure_after_the_blocks_are_lent_gives_them_back(llm, monkeypatch):
    kv = llm.llm_engine.scheduler.kv_cache_manager
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def broken(*args, **kwargs):
        raise RuntimeError("the loop's inputs could not be made")

    monkeypatch.setattr("jvllm.step_loop.prepare_step_inputs", broken)
    with pytest.raises(RuntimeError, match="could not be made"):
        StepLoop(llm).prefill(PROMPTS, greedy)
    monkeypatch.undo()
    engine = llm.llm_engine
    assert not engine.held_by_step_loop and not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert _run_loop(llm, greedy, num_steps=6, steps_per_call=6) == _generate(llm, greedy)


def test_an_engine_that_speculates_is_refused(tiny_llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, speculative_config=spec)
    with pytest.raises(ValueError, match="does not run with speculative_config"):
        StepLoop(llm)
