"""LoRA adapters: greedy outputs token for token equal to PEFT's on the same adapters (PEFT
writes them, PEFT runs them), several adapters and the base model in one batch and in turn
through fewer slots, and every way an adapter or a request can be refused."""

import json
import os

import peft
import pytest
import torch
import transformers
from family_parity import TINY_SHAPES, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from jvllm.lora.request import LoRARequest, parse_lora_module

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Prompts as token ids; the long one fills a 16-token block, so that the prefix cache could
# share it between adapters if its hash ignored them.
PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50))]
MAX_TOKENS = 8
# One engine shape for the tests on the tiny Llama, so that they share compiled steps.
ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_batched_tokens": 16}


def save_adapter(base_dir: str, path: str, seed: int, **lora_config):
    """A PEFT LoRA adapter with random A and B (PEFT's default B is zero: a no-op), saved to
    `path`; returns the PEFT model (float32, eval) that runs it."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model.eval()


def peft_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir):
    """Two adapters on the tiny Llama and each one's expected outputs (None: the base's)."""
    root = tmp_path_factory.mktemp("lora")
    first = save_adapter(
        tiny_llama_dir, str(root / "all"), 1, r=8, lora_alpha=16, target_modules=ALL_MODULES
    )
    # rsLoRA's scaling (alpha / sqrt(r)), on two of q|k|v only: the others' slots stay zero.
    second = save_adapter(
        tiny_llama_dir,
        str(root / "qv"),
        2,
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj"],
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    requests = {
        "all": LoRARequest("all", 1, str(root / "all")),
        "qv": LoRARequest("qv", 2, str(root / "qv")),
        None: None,
    }
    expected = {
        name: [peft_greedy(model, p) for p in PROMPTS]
        for name, model in (("all", first), ("qv", second), (None, base.eval()))
    }
    return requests, expected, root


def _run(llm: LLM, adapters, order) -> None:
    requests, expected, _ = adapters
    prompts = [p for _ in order for p in PROMPTS]
    per_prompt = [requests[name] for name in order for _ in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = [ids for name in order for ids in expected[name]]
    assert got == want


def test_adapters_and_the_base_model_in_one_batch_match_peft(adapters, tiny_llama_dir):
    _, expected, _ = adapters
    # Each adapter changes every output: the comparison could not pass by ignoring one.
    for name in ("all", "qv"):
        assert all(a != b for a, b in zip(expected[name], expected[None]))
    llm = LLM(tiny_llama_dir, **ENGINE)
    _run(llm, adapters, ["all", "qv", None])
    _run(llm, adapters, [None, "qv", "all"])  # again, over the prefix cache's blocks


def test_one_slot_serves_two_adapters_in_turn(adapters, tiny_llama_dir):
    """With max_loras=1 the scheduler holds back the second adapter's requests while the
    first's run (the base model's run beside either); the slot is then rewritten, "qv"'s
    zeros included where "all" had weights. Decode windows carry each row's slot."""
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, num_scheduler_steps=4)
    _run(llm, adapters, ["all", None, "qv", "all"])


def test_scheduler_runs_no_more_adapters_than_slots():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256, max_loras=1), kv)
    params = SamplingParams(max_tokens=4)
    adapters = [LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b"), None, None]
    for i, adapter in enumerate(adapters):
        scheduler.add_request(Request(str(i), [1, 2, 3], params, None, lora_request=adapter))
    scheduled = {r.request_id for r in scheduler.schedule().scheduled_requests}
    assert scheduled == {"0", "2", "3"}  # "b" waits; the base model's requests pass it
    assert [r.request_id for r in scheduler.waiting] == ["1"]


def test_a_fused_checkpoint_module_matches_peft(tmp_path):
    """Phi-3 saves q|k|v and gate|up fused: one adapter module for each fused projection."""
    config = transformers.Phi3Config(**TINY_SHAPES, pad_token_id=0, tie_word_embeddings=False)
    save_random_model(str(tmp_path / "base"), config)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    model = save_adapter(
        str(tmp_path / "base"), str(tmp_path / "lora"), 3, r=4, lora_alpha=4,
        target_modules=targets,
    )  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert peft_greedy(model, prompt) != peft_greedy(base.float().eval(), prompt)
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=4, async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("phi", 1, str(tmp_path / "lora"))
    out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == peft_greedy(model, prompt)


def _rewrite_config(src, dst, **changes) -> str:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        with open(os.path.join(dst, name), "wb") as f:
            f.write(data)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump({**config, **changes}, f)
    return str(dst)


def test_bad_adapters_and_requests_are_refused_clearly(adapters, tiny_llama_dir, tmp_path):
    requests, _, root = adapters
    save_adapter(tiny_llama_dir, str(tmp_path / "r16"), 5, r=16, target_modules=["o_proj"])
    cut = _rewrite_config(root / "qv", tmp_path / "cut")
    os.truncate(os.path.join(cut, "adapter_model.safetensors"), 4)  # a copy cut short
    llm = LLM(tiny_llama_dir, **ENGINE)
    engine = llm.llm_engine
    refusals = [
        (LoRARequest("cut", 6, cut), "adapter_model.safetensors is not a readable safetensors"),
        (LoRARequest("r16", 9, str(tmp_path / "r16")), "rank 16 .* above max_lora_rank=8"),
        (LoRARequest("gone", 7, str(tmp_path / "missing")), "no adapter_config.json"),
        (
            LoRARequest("dora", 8, _rewrite_config(root / "qv", tmp_path / "dora", use_dora=True)),
            "DoRA adapters are not supported",
        ),
        (
            LoRARequest("other", 2, str(root / "all")),  # id 2 is "qv" once "qv" is known
            "already names adapter 'qv'",
        ),
        ("qv", "must be a jvllm.lora.request.LoRARequest"),
    ]
    engine.add_request("ok", PROMPTS[0], lora_request=requests["qv"])
    for i, (lora, message) in enumerate(refusals):
        with pytest.raises((ValueError, TypeError), match=message):
            engine.add_request(f"bad-{i}", PROMPTS[0], lora_request=lora)
    assert not any(engine.has_request(f"bad-{i}") for i in range(len(refusals)))
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, or a list"):
        llm.generate(PROMPTS, lora_request=[requests["qv"]])


def test_an_adapter_for_the_lm_head_is_refused(tmp_path, tiny_llama_dir):
    save_adapter(tiny_llama_dir, str(tmp_path / "head"), 4, r=2, target_modules=["lm_head"])
    llm = LLM(tiny_llama_dir, enable_lora=True)
    with pytest.raises(ValueError, match="lm_head cannot take a LoRA adapter .* may target"):
        llm.generate(PROMPTS, lora_request=LoRARequest("head", 1, str(tmp_path / "head")))
    plain = LLM(tiny_llama_dir)
    with pytest.raises(ValueError, match="needs an engine started with enable_lora=True"):
        plain.generate(PROMPTS, lora_request=LoRARequest("head", 1, str(tmp_path / "head")))


def test_lora_module_flags_parse_both_of_vllms_forms():
    assert parse_lora_module("sql=/a/b") == LoRARequest("sql", 1, "/a/b")
    parsed = parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "m"}')
    assert parsed == LoRARequest("sql", 1, "/a", "m")
    for bad in ("sql", "=/a", '{"name": "x"}'):
        with pytest.raises(ValueError, match="LoRA module"):
            parse_lora_module(bad)


def test_server_serves_adapters_by_model_name(adapters, tiny_llama_dir, monkeypatch, tmp_path):
    """--lora-modules' adapters answer to their names (and are listed with the base model as
    parent); more load and unload at run time under VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    httpx = pytest.importorskip("httpx")
    from jvllm.engine.async_llm import AsyncLLM
    from jvllm.engine.metrics import ServingMetrics
    from jvllm.entrypoints.openai.api_server import build_app
    from jvllm.entrypoints.openai.server_thread import ServerThread

    _, expected, root = adapters
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = AsyncLLM(LLM(tiny_llama_dir, **ENGINE).llm_engine)
    modules = [parse_lora_module(f"all={root / 'all'}")]
    metrics = ServingMetrics(engine, "tiny")
    engine.stat_loggers.append(metrics)
    app = build_app(engine, "tiny", metrics=metrics, lora_modules=modules)
    server = ServerThread(app).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=60)
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("all", "tiny")]

        def complete(model):
            body = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            return client.post("/v1/completions", json=body)

        reply = complete("all").json()
        assert reply["choices"][0]["token_ids"] == expected["all"][1] and reply["model"] == "all"
        assert complete("tiny").json()["choices"][0]["token_ids"] == expected[None][1]
        missing = complete("qv")
        assert missing.status_code == 404 and "`qv` does not exist" in missing.text
        load = {"lora_name": "qv", "lora_path": str(root / "qv")}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert complete("qv").json()["choices"][0]["token_ids"] == expected["qv"][1]
        bad = client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
        )
        assert bad.status_code == 400 and "no adapter_config.json" in bad.text
        scrape = client.get("/metrics").text  # vLLM's gauge of the adapters in play
        assert 'lora_requests_info{max_lora="2",running_lora_adapters="",waiting' in scrape
        unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
        assert unload.status_code == 200
        assert complete("qv").status_code == 404
    finally:
        server.stop()
        engine.shutdown()
