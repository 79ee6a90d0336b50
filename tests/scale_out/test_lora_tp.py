"""LoRA adapters over the mesh: at T = 2 (each device its KV heads) and T = 4 (KV heads
repeated), and over D = 2 replicas, the tokens PEFT gives, adapters and the base model mixed in
one batch."""

import pytest
from family_parity import save_tp_llama
from test_lora import ALL_MODULES, peft_greedy, save_adapter

from jvllm import LLM, SamplingParams
from jvllm.lora.request import LoRARequest

PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50))]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A Llama with 2 KV heads, two PEFT adapters on it and each one's expected tokens."""
    root = tmp_path_factory.mktemp("lora_tp")
    base = save_tp_llama(root / "base", 2, tie=False)
    models = {
        "all": save_adapter(base, str(root / "all"), 1, r=8, lora_alpha=16,
                            target_modules=ALL_MODULES),
        "kv": save_adapter(base, str(root / "kv"), 2, r=4, lora_alpha=8,
                           target_modules=["k_proj", "v_proj", "down_proj"]),
    }  # fmt: skip
    requests = {
        "all": LoRARequest("all", 1, str(root / "all")),
        "kv": LoRARequest("kv", 2, str(root / "kv")),
    }
    expected = {name: [peft_greedy(m, p) for p in PROMPTS] for name, m in models.items()}
    return base, requests, expected


@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4}, {"data_parallel_size": 2}],
    ids=["t2", "t4_repeated_kv_heads", "d2"],
)
def test_adapters_over_the_mesh_match_peft(adapted, parallel):
    base, requests, expected = adapted
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", **parallel)
    order = ["all", "kv", "all"]
    prompts = [p for _ in order for p in PROMPTS]
    adapters = [requests[name] for name in order for _ in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [ids for name in order for ids in expected[name]]
