"""The engine's public API: validation at the edge, aborts, seeded sampling, output shape."""

import logging
import time

import pytest

from jvllm import LLM, LLMEngine, SamplingParams
from jvllm.entrypoints.openai.api_server import build_server_engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=128,
        max_num_seqs=8,
        max_model_len=256,
    )


def test_outputs_come_back_in_input_order_with_vllm_fields(llm):
    prompts = ["one two three", "a", [5, 6, 7, 8, 9]]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt for o in outs] == ["one two three", "a", None]
    assert outs[2].prompt_token_ids == [5, 6, 7, 8, 9]
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_model_runner_counts_dispatch_and_device_wait_within_the_wall_time(llm):
    runner = llm.llm_engine.model_runner
    dispatch, wait = runner.dispatch_seconds, runner.device_wait_seconds
    start = time.perf_counter()
    llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    spent_dispatching = runner.dispatch_seconds - dispatch
    spent_waiting = runner.device_wait_seconds - wait
    assert spent_dispatching > 0 and spent_waiting >= 0
    assert spent_dispatching + spent_waiting < elapsed


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(llm):
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True
    )
    alone = llm.generate(["the seed prompt"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)
    batch = llm.generate(
        ["x y z", "the seed prompt", "lorem ipsum dolor"], [others, params, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate(
        ["the seed prompt"] * 2,
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_stop_token_ids_and_stop_strings_end_requests(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = llm.generate(["stop here"], greedy, use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    out = llm.generate(
        ["stop here"],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    stop_str = ref.text[len(ref.text) // 2 :][:3]
    assert stop_str.strip()
    out = llm.generate(
        ["stop here"],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop_str]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == ref.text[: ref.text.index(stop_str)]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 49152], SamplingParams(), r"\[0, 49152\)"),
        ([-1], SamplingParams(), r"\[0, 49152\)"),
        ("hi", SamplingParams(max_tokens=300), "max_model_len"),
        ([5] * 256, SamplingParams(max_tokens=None), "leaves no room to generate"),
    ],
)
def test_bad_requests_are_rejected_before_entering_the_engine(llm, prompt, params, match):
    engine: LLMEngine = llm.llm_engine
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == free
    engine.add_request("bad", "now fine", SamplingParams(max_tokens=2))  # the id was not taken
    while engine.has_unfinished_requests():
        engine.step()


def test_max_tokens_none_generates_until_max_model_len(llm):
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    [out] = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 256 - 4 and out.outputs[0].finish_reason == "length"
    assert params.max_tokens is None  # the caller's params are left as they were


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt = list(range(5, 45))
    greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    [cut, tail] = llm.generate(
        [prompt, prompt[-7:]],
        [SamplingParams(**greedy, truncate_prompt_tokens=7), SamplingParams(**greedy)],
        use_tqdm=False,
    )
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1: the last max_model_len tokens, which leave no room to generate: refused as such.
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([list(range(300))], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([prompt], SamplingParams(truncate_prompt_tokens=257), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)


def test_vllm_keywords_for_what_jvllm_does_not_do_take_only_their_defaults(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert llm.generate(["hi"], params, use_tqdm=False, lora_request=None, priority=[0])
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(["hi"], params, lora_request=object())
    with pytest.raises(ValueError, match="needs the engine option scheduling_policy='priority'"):
        llm.generate(["hi"], params, priority=[1])
    with pytest.raises(ValueError, match=r"priority must be a list with one int a prompt \(1\)"):
        llm.generate(["hi"], params, priority=[0, 0])


def test_priority_policy_serves_lower_priorities_first(tiny_llama_dir):
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([[5, 6], [7, 8], [9, 10]], params, use_tqdm=False, priority=[2, 0, 1])
    alone = [llm.generate([o.prompt_token_ids], params, use_tqdm=False)[0] for o in outputs]
    assert [o.outputs[0].token_ids for o in outputs] == [a.outputs[0].token_ids for a in alone]
    # One request at a time: each finishes before the next in priority order starts.
    done = [o.metrics.finished_time for o in outputs]
    assert done[1] < done[2] < done[0]
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        LLM(tiny_llama_dir, scheduling_policy="lifo")


def test_abort_frees_blocks_and_the_loop_keeps_serving(llm):
    engine: LLMEngine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    free = manager.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", "first request", params)
    engine.add_request("b", "second request", params)
    engine.step()
    engine.step()
    assert manager.num_free_blocks < free
    engine.abort_request("a")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"]
    assert manager.num_free_blocks == free


def test_sampling_params_errors_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_buckets_compile_on_first_use_by_default_and_up_front_for_a_server(
    tiny_llama_weights_dir, monkeypatch, background_compiles
):
    kwargs = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32}
    llm = LLM(tiny_llama_weights_dir, **kwargs)
    runner = llm.llm_engine.model_runner
    assert runner.compiler.num_compilations == 0
    records = []  # jvllm's loggers do not propagate to the root
    handler = logging.Handler()
    handler.emit = records.append
    monkeypatch.setattr(logging.getLogger("jvllm.worker.executables"), "handlers", [handler])
    llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    # The 3-token prefill and the 1-sequence decode: 2 of the 4 buckets. The prefill's compiles
    # in the step that needs it; the decode bucket, which the prefill's sequence needs next,
    # compiles beside it in the background.
    assert runner.compiler.num_compilations == 2 < len(runner.buckets.all_buckets())
    messages = [r.getMessage() for r in records]
    assert sum("mixed bucket" in m and "on first use" in m for m in messages) == 1
    # (Other tests' engines may still be logging background compiles.)
    assert not any("decode bucket" in m and "on first use" in m for m in messages)

    engine, _, _ = build_server_engine(tiny_llama_weights_dir, **kwargs)
    try:
        server_runner = engine.engine.model_runner
        server_runner.compiler.wait_for_compiles()  # the server compiles them in the background
        assert server_runner.compiler.num_compilations == len(server_runner.buckets.all_buckets())
    finally:
        engine.shutdown()


def test_a_tokenizer_from_elsewhere_or_none(tiny_llama_weights_dir, tiny_llama_dir):
    """vLLM's tokenizer= and skip_tokenizer_init=: a model without a tokenizer takes a
    directory's or a GGUF's (the default model's; the same vocabulary), or runs on token ids."""
    from jvllm.model_loader.default_model import resolve_default_model

    kwargs = {"max_model_len": 128, "max_num_seqs": 2, "max_num_batched_tokens": 64}
    params = SamplingParams(temperature=0, max_tokens=4)
    want = LLM(tiny_llama_dir, **kwargs).generate(["Hello there"], params, use_tqdm=False)[0]
    for tokenizer in (tiny_llama_dir, resolve_default_model()):
        llm = LLM(tiny_llama_weights_dir, tokenizer=tokenizer, **kwargs)
        got = llm.generate(["Hello there"], params, use_tqdm=False)[0]
        assert (got.prompt_token_ids, got.outputs[0].text) == (
            want.prompt_token_ids,
            want.outputs[0].text,
        )
    bare = LLM(tiny_llama_dir, skip_tokenizer_init=True, **kwargs)
    assert bare.get_tokenizer() is None
    ids = {"prompt_token_ids": want.prompt_token_ids}
    out = bare.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want.outputs[0].token_ids and out.text == ""
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.llm_engine.add_request("s", ids, SamplingParams(stop=["x"]))
    assert not bare.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="tokenizer='/no/such/dir' is neither a local directory"):
        LLM(tiny_llama_weights_dir, tokenizer="/no/such/dir")


def test_vllm_engine_options_that_change_nothing_here_are_taken():
    from jvllm.engine.arg_utils import EngineArgs

    args = EngineArgs(trust_remote_code=True, enforce_eager=True, dtype="float")
    assert args.dtype == "float32"
    with pytest.raises(TypeError, match="enforce_eager must be a bool"):
        EngineArgs(enforce_eager="yes")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        EngineArgs(dtype="float16")
    # More of vLLM's, at the values its scripts pass, and refused where they would ask for more.
    EngineArgs(
        tokenizer_mode="auto",
        swap_space=4,
        disable_log_stats=True,
        distributed_executor_backend="mp",
        compilation_config={"level": 3},
        served_model_name="m",
    )
    for name, value, why in (
        ("tokenizer_mode", "mistral", "Hugging Face tokenizer"),
        ("revision", "main", "no model hub"),
        ("pipeline_parallel_size", 2, "tensor_parallel_size"),
        ("cpu_offload_gb", 4, "on the device"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be .*{why}.*; got {value!r}"):
            EngineArgs(**{name: value})
