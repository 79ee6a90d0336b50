"""What RL training loops call between steps (engine/sleep.py): sleep, wake_up, load_weights and
reset_prefix_cache, against HF transformers on tiny random Llamas; nothing compiles again."""

import copy
import glob

import numpy as np
import pytest
import torch
import transformers
from conftest import hf_greedy
from family_parity import TINY_SHAPES, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.engine.sleep import EngineSleepingError
from jvllm.model_loader.safetensors_file import read_safetensors

ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 128,
          "max_num_batched_tokens": 64, "enable_sleep_mode": True}  # fmt: skip
MAX_TOKENS = 6
# Prompts of 1 to 3 blocks: a rerun of the longest hits its cached first two.
PROMPTS = [np.random.default_rng(0).integers(0, 512, n).tolist() for n in (5, 20, 40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas of one config but for their weights (untied LM heads): (dir, HF model)
    each, and each one's greedy tokens on PROMPTS."""
    config = transformers.LlamaConfig(**TINY_SHAPES)
    out = []
    for seed in (0, 1):
        path = tmp_path_factory.mktemp(f"llama{seed}")
        hf = save_random_model(path, config, seed=seed)
        out.append((str(path), hf, [_hf(hf, p) for p in PROMPTS]))
    return out


def _hf(hf_model, prompt):
    hf_model.generation_config.eos_token_id = None
    return hf_greedy(hf_model, prompt, MAX_TOKENS)


def _generate(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _checkpoint(path):
    return read_safetensors(glob.glob(f"{path}/*.safetensors")[0])


def test_sleep_wake_and_new_weights_decode_like_hf_without_recompiling(models):
    (path_a, _, expected_a), (_, hf_b, expected_b) = models
    llm = LLM(path_a, **ENGINE)
    runner = llm.llm_engine.model_runner
    assert _generate(llm) == expected_a
    num_compilations = runner.compiler.num_compilations
    old_param, old_kv = runner.params["embed"]["embedding"], runner.kv_cache

    llm.sleep(level=1)
    assert llm.is_sleeping() and old_param.is_deleted() and old_kv.is_deleted()
    with pytest.raises(EngineSleepingError, match="call wake_up"):
        _generate(llm)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _generate(llm) == expected_a, "after sleep(1)"

    llm.sleep(level=2)
    with pytest.raises(ValueError, match="discarded the weights.*load the weights first"):
        llm.wake_up()
    llm.load_weights(_checkpoint(path_a).items())
    llm.wake_up()
    assert _generate(llm) == expected_a, "after sleep(2) and load_weights"

    # The RL step: a trained model's state_dict (torch tensors) into the running engine. Its
    # prompts' blocks are cached from the old weights: the reset keeps them from being reused.
    llm.load_weights(hf_b.state_dict().items())
    assert _generate(llm) == expected_b, "the second model's weights"
    assert runner.compiler.num_compilations == num_compilations


def test_load_weights_takes_whole_params_of_a_subset(models):
    (path_a, hf_a, _), (path_b, _, _) = models
    llm = LLM(path_a, **ENGINE)
    tensors_b = _checkpoint(path_b)
    with pytest.raises(ValueError, match=r"'layers.attn.qkv.weight'.*missing.*v_proj"):
        llm.load_weights((n, t) for n, t in tensors_b.items() if "v_proj" not in n)
    with pytest.raises(ValueError, match="no param made of 'model.layers.0.foo'"):
        llm.load_weights([("model.layers.0.foo", np.zeros(3))])
    assert llm.load_weights([("lm_head.weight", tensors_b["lm_head.weight"])]) == {"lm_head.weight"}
    mixed = copy.deepcopy(hf_a)  # model A with model B's LM head
    with torch.no_grad():
        mixed.lm_head.weight.copy_(torch.from_numpy(tensors_b["lm_head.weight"].copy()))
    assert _generate(llm) == [_hf(mixed, p) for p in PROMPTS]


def test_reset_prefix_cache_drops_hits_and_refuses_while_blocks_are_held(models):
    path_a, _, expected_a = models[0]
    llm = LLM(path_a, **ENGINE)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    longest = [PROMPTS[-1]]
    assert _generate(llm, longest) == expected_a[-1:]
    hits = manager.prefix_cache_hits
    assert _generate(llm, longest) == expected_a[-1:] and manager.prefix_cache_hits > hits
    assert llm.reset_prefix_cache()
    hits = manager.prefix_cache_hits
    assert _generate(llm, longest) == expected_a[-1:] and manager.prefix_cache_hits == hits

    engine = llm.llm_engine
    engine.add_request("held", {"prompt_token_ids": PROMPTS[-1]}, SamplingParams(max_tokens=4))
    engine.step()
    assert not llm.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.sleep()
    engine.abort_request("held")


def test_sleep_refuses_what_it_cannot_do(models):
    path_a = models[0][0]
    llm = LLM(path_a, **{**ENGINE, "enable_sleep_mode": False, "quantization": "int8"})
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    llm.llm_engine.sleep_mode._enabled = True  # as if started with it: one engine less to load
    with pytest.raises(ValueError, match=r"sleep level must be one of \(1, 2\)"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="quantized weights.*use sleep\\(level=1\\)"):
        llm.sleep(level=2)
    with pytest.raises(ValueError, match="load_weights does not take quantized weights"):
        llm.load_weights(_checkpoint(path_a).items())
    llm.sleep()  # level 1 keeps any weights
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["kv"])
    llm.wake_up()
    assert not llm.is_sleeping() and len(_generate(llm, PROMPTS[:1])[0]) == MAX_TOKENS


def test_dev_routes_sleep_and_wake_the_server(models, monkeypatch):
    httpx = pytest.importorskip("httpx")
    from jvllm.engine.async_llm import AsyncLLM
    from jvllm.entrypoints.openai.api_server import build_app
    from jvllm.entrypoints.openai.server_thread import ServerThread

    path_a, _, expected_a = models[0]
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    engine = AsyncLLM(LLM(path_a, **ENGINE).llm_engine)
    server = ServerThread(build_app(engine, "tiny")).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=60)

        def complete():
            body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            return client.post("/v1/completions", json=body)

        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert client.post("/sleep", params={"level": 1}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        asleep = complete()
        assert asleep.status_code == 503 and "POST /wake_up" in asleep.text
        bad = client.post("/wake_up", params={"tags": ["kv"]})
        assert bad.status_code == 400 and "tags must be among" in bad.text
        assert client.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert client.post("/wake_up").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert complete().json()["choices"][0]["token_ids"] == expected_a[1]
        assert client.post("/reset_prefix_cache").status_code == 200
        level = client.post("/sleep", params={"level": 3})
        assert level.status_code == 400 and "sleep level must be one of" in level.text
    finally:
        server.stop()
        engine.shutdown()


def test_a_request_reaching_a_sleeping_engine_is_a_503(models):
    """A request that passed the dev routes' middleware before the engine slept (or any
    request, where the engine is put to sleep in-process) is the server's 503, not a 500."""
    httpx = pytest.importorskip("httpx")
    import asyncio

    from jvllm.engine.async_llm import AsyncLLM
    from jvllm.entrypoints.openai.api_server import build_app
    from jvllm.entrypoints.openai.server_thread import ServerThread

    engine = AsyncLLM(LLM(models[0][0], **ENGINE).llm_engine)
    server = ServerThread(build_app(engine, "tiny")).start()  # no dev routes: no middleware
    try:
        asyncio.run(engine.call_engine(lambda e: e.sleep(1)))
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503 and "call wake_up()" in reply.text
    finally:
        server.stop()
        engine.shutdown()
