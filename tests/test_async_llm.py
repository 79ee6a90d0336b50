"""AsyncLLM: concurrent requests share steps, outputs shape as asked, errors stay per request."""

import asyncio

import pytest

from jvllm import LLMEngine, SamplingParams
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestOutputKind
from jvllm.engine.output_shaper import OutputShaper

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(
        tiny_llama_dir,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        compile_all_buckets=False,
    )


@pytest.fixture
def async_llm(engine):
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


async def _collect(llm, prompt, request_id, params=GREEDY, kind=None):
    return [o async for o in llm.generate(prompt, params, request_id, output_kind=kind)]


def test_concurrent_requests_share_steps_and_deltas_join_to_final_text(async_llm, engine):
    num_steps = 0
    step = engine.step

    def counting_step():
        nonlocal num_steps
        num_steps += 1
        return step()

    engine.step = counting_step
    try:

        async def main():
            prompts = [f"prompt {i} goes here" for i in range(8)]
            finals = await asyncio.gather(
                *(
                    _collect(async_llm, p, f"final-{i}", kind=RequestOutputKind.FINAL_ONLY)
                    for i, p in enumerate(prompts)
                )
            )
            deltas = await asyncio.gather(
                *(
                    _collect(async_llm, p, f"delta-{i}", kind=RequestOutputKind.DELTA)
                    for i, p in enumerate(prompts)
                )
            )
            return finals, deltas

        finals, deltas = asyncio.run(main())
    finally:
        del engine.step
    for final, delta in zip(finals, deltas):
        assert len(final) == 1 and final[0].finished
        assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
        assert sum(len(o.outputs[0].token_ids) for o in delta) == 8
    # 16 requests x 8 tokens in two waves of 8: batched, far fewer steps than tokens.
    assert num_steps <= 2 * (8 + 2)


def test_cumulative_outputs_grow(async_llm):
    outputs = asyncio.run(_collect(async_llm, "grow", "cum", kind=RequestOutputKind.CUMULATIVE))
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 8 and outputs[-1].finished


def test_streamed_text_holds_back_a_possible_stop_string_once(async_llm):
    # The engine's running text already withholds what may start a stop string ("QQQQ": 3
    # characters); the deltas made from it must not withhold them a second time.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["QQQQ"])
    prompt = "streaming with a stop string"
    cumulative = asyncio.run(
        _collect(async_llm, prompt, "cum", params, RequestOutputKind.CUMULATIVE)
    )
    full_text = cumulative[-1].outputs[0].text
    assert all(len(o.outputs[0].text) <= len(full_text) - 3 for o in cumulative[:-1])
    shaper = OutputShaper(RequestOutputKind.DELTA)
    sent = ""
    for output in cumulative:
        delta = shaper.shape(output, output.outputs, output.finished)
        if delta is not None:
            sent += delta.outputs[0].text
        assert sent == output.outputs[0].text  # each step sends all the engine let through
    assert sent == full_text


def test_abort_ends_the_stream_and_frees_blocks(async_llm, engine):
    kv = engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        outputs = []
        async for output in async_llm.generate("abort me", long, "victim"):
            outputs.append(output)
            if len(outputs) == 2:
                await async_llm.abort("victim")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == free_before


def test_abort_takes_several_ids_and_keeps_tokens_the_consumer_had_not_read(async_llm, engine):
    """vLLM's `await abort(ids)`: a list ends those requests only, and a slow consumer's last
    output still brings every token the engine had sent it (a DELTA stream's tokens add up)."""
    kv = engine.scheduler.kv_cache_manager
    free_before = kv.num_free_blocks
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def slow_reader(request_id: str) -> list[int]:
        token_ids = []
        async for output in async_llm.generate("abort me", long, request_id, output_kind=DELTA):
            token_ids += output.outputs[0].token_ids
            while (request := engine._requests.get(request_id)) and request.num_output_tokens < 6:
                await asyncio.sleep(0.01)  # the engine goes on; this consumer reads nothing
            if request is not None:
                await async_llm.abort(["a", "b", "a"])
                while request_id in engine._requests:  # the abort lands before the next read
                    await asyncio.sleep(0.01)
        assert output.finished and output.outputs[0].finish_reason == "abort"
        return token_ids

    async def main():
        aborted = asyncio.gather(slow_reader("a"), slow_reader("b"))
        kept = _collect(async_llm, "go on", "c")
        return await asyncio.gather(aborted, kept)

    (tokens_a, tokens_b), kept = asyncio.run(main())
    # Whichever reader aborted first had waited for 6 tokens; the other may have joined later.
    assert max(len(tokens_a), len(tokens_b)) >= 6 and min(len(tokens_a), len(tokens_b)) >= 3
    assert kept[-1].outputs[0].finish_reason == "length" and async_llm.is_running
    assert not engine.has_unfinished_requests() and kv.num_free_blocks == free_before
    with pytest.raises(TypeError, match="request_id must be a str"):
        asyncio.run(async_llm.abort([1]))


def test_from_engine_args_takes_engine_args(tiny_llama_dir):
    args = EngineArgs(
        tiny_llama_dir, max_model_len=64, max_num_seqs=2, scheduling_policy="priority"
    )
    llm = AsyncLLM.from_engine_args(args)

    async def main():
        defaults = llm.generate("hello", GREEDY, "r", lora_request=None, priority=3)
        outputs = [o async for o in defaults]
        with pytest.raises(TypeError, match="priority must be an int"):
            await anext(llm.generate("hello", GREEDY, "s", priority="high"))
        return outputs

    try:
        outputs = asyncio.run(main())
        assert len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


def test_breaking_out_of_generate_aborts_the_request(async_llm, engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = async_llm.generate("leave early", long, "leaver")
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(200):
            if not engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_bad_request_fails_alone(async_llm):
    async def main():
        good = asyncio.create_task(_collect(async_llm, "fine", "good"))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(async_llm, list(range(100, 400)), "too-long")
        with pytest.raises(ValueError):
            await _collect(async_llm, "dup", "good")  # its id is in use
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8


def test_output_failure_of_one_request_reaches_only_it(async_llm, engine):
    detokenize = engine.output_processor.detokenize

    def failing(request):
        if request.request_id == "broken":
            raise RuntimeError("boom")
        return detokenize(request)

    engine.output_processor.detokenize = failing
    try:

        async def main():
            good = asyncio.create_task(_collect(async_llm, "fine", "fine-1"))
            with pytest.raises(RuntimeError, match="broken"):
                await _collect(async_llm, "bad", "broken")
            return await good

        outputs = asyncio.run(main())
    finally:
        del engine.output_processor.detokenize
    assert outputs[-1].finished


def test_shutdown_fails_pending_and_new_requests(engine):
    llm = AsyncLLM(engine)

    async def main():
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        agen = llm.generate("running", long, "pending")
        await agen.__anext__()
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            await _collect(llm, "after", "after")

    asyncio.run(main())
    assert not llm.is_running
    assert not engine.has_unfinished_requests()  # shutdown aborted what was left


def test_engine_step_error_reaches_every_request(engine):
    llm = AsyncLLM(engine)

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    try:

        async def main():
            results = await asyncio.gather(
                _collect(llm, "a", "x1"), _collect(llm, "b", "x2"), return_exceptions=True
            )
            return results

        results = asyncio.run(main())
    finally:
        del engine.step
        llm.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert llm.errored and not llm.is_running
    assert not engine.has_unfinished_requests()
