"""Sleep mode in a group of data-parallel ranks whose MoE layers run across them (D = 2 on fake
CPU devices, worker/rank_group_worker.py): the group's params and the one KV cache that holds
every rank's pages are freed once every rank sleeps, come back as one rank wakes them, and the
ranks then decode as before, with nothing compiled again."""

import glob
import time

import jax
import pytest
from family_parity import ragged_prompts, save_random_model
from test_expert_parallel import FAMILIES
from test_families_tp import FAMILY_VOCAB

from jvllm import LLM, SamplingParams
from jvllm.engine.sleep import EngineSleepingError
from jvllm.model_loader.safetensors_file import read_safetensors

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPTS = ragged_prompts(FAMILY_VOCAB, lengths=(3, 9, 14))  # ranks 0, 1, 0


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixtral")
    save_random_model(path, FAMILIES["mixtral"]())
    return str(path)


def _group(path: str, **kwargs) -> LLM:
    return LLM(
        path,
        data_parallel_size=2,
        enable_expert_parallel=True,
        enable_sleep_mode=True,
        **ENGINE_KWARGS,
        **kwargs,
    )


def _greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _is_deleted(tree) -> bool:
    return all(a.is_deleted() for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("drafts", [False, True])
def test_level_1_frees_the_weights_and_every_ranks_kv_and_wakes_as_one_device(mixtral, drafts):
    """With a draft model too (the target as its own draft), whose params and KV pages go and
    come back with the target's."""
    expected = _greedy(LLM(mixtral, **ENGINE_KWARGS))
    spec = {"method": "draft_model", "model": mixtral, "num_speculative_tokens": 2}
    llm = _group(mixtral, speculative_config=spec) if drafts else _group(mixtral)
    group = llm.llm_engine.group.group_runner()
    assert _greedy(llm) == expected
    num_compilations = group.num_compilations
    params, kv_cache, token_cache = group._step_params(), group.kv_cache, group.token_cache
    assert len(jax.tree.leaves(kv_cache)[-1].sharding.device_set) == 2  # both ranks' pages

    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert _is_deleted(params) and _is_deleted(kv_cache) and token_cache.is_deleted()
    with pytest.raises(EngineSleepingError, match="call wake_up"):
        _greedy(llm)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and group.params is not None and group.kv_cache is None
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _greedy(llm) == expected
    assert group.num_compilations == num_compilations
    if drafts:
        assert all(e.spec_decoding_stats.num_accepted_tokens for e in llm.llm_engine.replicas)


def test_level_2_discards_the_weights_until_load_weights_brings_them(mixtral, monkeypatch):
    """The ranks share their weights: load_weights reads them once for the group."""
    llm = _group(mixtral)
    expected = _greedy(llm)
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="discarded the weights.*load the weights first"):
        llm.wake_up()
    (checkpoint,) = glob.glob(f"{mixtral}/*.safetensors")
    device_sleep, loads = llm.llm_engine.group.device_sleep, []
    load = device_sleep.load_weights
    monkeypatch.setattr(device_sleep, "load_weights", lambda w: loads.append(1) or load(w))
    llm.load_weights(read_safetensors(checkpoint).items())
    assert len(loads) == 1
    llm.wake_up()
    assert _greedy(llm) == expected


def test_a_busy_rank_refuses_sleep_for_the_group_and_each_rank_sleeping_frees_it(mixtral):
    llm = _group(mixtral)
    engine, group = llm.llm_engine, llm.llm_engine.group.group_runner()
    for i in range(2):  # one on each rank
        engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, GREEDY)
    engine.abort_request("r0")
    assert [r.get_num_unfinished_requests() for r in engine.replicas] == [0, 1]
    for call in (llm.sleep, lambda: llm.load_weights([])):
        with pytest.raises(RuntimeError, match="1 requests are unfinished"):
            call()
    assert not llm.is_sleeping() and not _is_deleted(group.kv_cache)

    engine.abort_request("r1")
    engine.replicas[0].sleep()
    assert not _is_deleted(group.kv_cache)  # rank 1 is awake
    engine.replicas[1].sleep()
    assert _is_deleted(group.kv_cache) and _is_deleted(group.params)
    llm.wake_up()
    assert [len(tokens) for tokens in _greedy(llm)] == [GREEDY.max_tokens] * len(PROMPTS)


def test_the_sleep_route_refuses_for_every_rank_while_one_is_busy(mixtral, monkeypatch):
    """Rank 1 streaming a request while rank 0 idles: the server's /sleep is a 400 that leaves
    both awake (not rank 0 asleep and rank 1 refusing)."""
    httpx = pytest.importorskip("httpx")
    from jvllm.engine.async_llm import AsyncLLM
    from jvllm.entrypoints.openai.api_server import build_app
    from jvllm.entrypoints.openai.server_thread import ServerThread

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    llm = _group(mixtral)
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, "tiny")).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=60)
        replicas = llm.llm_engine.replicas

        def stream(prompt):  # -> the open stream, its first chunk read: its rank decodes
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            opened = client.stream("POST", "/v1/completions", json=body)
            lines = opened.__enter__().iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            return opened, lines

        first, _ = stream(PROMPTS[0])  # rank 0
        second, lines = stream(PROMPTS[1])  # rank 1
        first.__exit__(None, None, None)  # rank 0's client leaves: its request is aborted
        while replicas[0].get_num_unfinished_requests():
            time.sleep(0.01)
        refused = client.post("/sleep", params={"level": 1})
        assert [r.get_num_unfinished_requests() for r in replicas] == [0, 1]
        assert refused.status_code == 400 and "requests are unfinished" in refused.text
        assert not any(r.is_sleeping() for r in replicas)
        assert next(line for line in lines if line.startswith("data: {"))  # still decoding
        second.__exit__(None, None, None)
    finally:
        server.stop()
        engine.shutdown()
