"""LoRA adapters in a group of data-parallel ranks whose MoE layers run across them
(worker/rank_adapters.py): each rank its own adapter slots, the group's one step running
every rank's adapters and base-model requests together, giving the tokens PEFT gives."""

import pytest
from family_parity import save_random_model
from test_expert_parallel import FAMILIES
from test_lora import peft_greedy, save_adapter

from jvllm import LLM, SamplingParams
from jvllm.lora.request import LoRARequest

PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50)), [7, 8, 9]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny Mixtral, two PEFT adapters on its attention, and each one's (and the base
    model's) greedy tokens from PEFT."""
    root = tmp_path_factory.mktemp("rank_group_lora")
    base = str(root / "base")
    save_random_model(base, FAMILIES["mixtral"]())
    models = {
        "all": save_adapter(base, str(root / "all"), 1, r=8, lora_alpha=16,
                            target_modules=ATTENTION),
        "kv": save_adapter(base, str(root / "kv"), 2, r=4, lora_alpha=8,
                           target_modules=["k_proj", "v_proj"]),
    }  # fmt: skip
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(models)}
    expected = {name: [peft_greedy(m, p) for p in PROMPTS] for name, m in models.items()}
    with models["all"].disable_adapter():
        expected[None] = [peft_greedy(models["all"], p) for p in PROMPTS]
    requests[None] = None
    return base, requests, expected


@pytest.mark.parametrize(("t", "num_scheduler_steps"), [(1, 1), (2, 1), (1, 4)])
def test_each_rank_runs_its_adapters_in_the_groups_step_as_peft_does(
    adapted, t, num_scheduler_steps
):
    """Two ranks (T devices each, Mixtral's experts over all of them), max_loras=2 a rank:
    both adapters and the base model in one batch, spread over the ranks by load, give PEFT's
    tokens, in steps and in the group's decode windows."""
    base, requests, expected = adapted
    llm = LLM(
        base,
        data_parallel_size=2,
        tensor_parallel_size=t,
        enable_expert_parallel=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        dtype="float32",
        max_num_batched_tokens=32,
        max_num_seqs=4,
        num_scheduler_steps=num_scheduler_steps,
    )
    order = ["all", None, "kv", "all"]
    prompts = [{"prompt_token_ids": p} for _ in order for p in PROMPTS]
    adapters = [requests[name] for name in order for _ in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [ids for name in order for ids in expected[name]]
    group = llm.llm_engine.group.group_runner()
    assert group.num_group_steps > 0
    assert (group.num_windows > 0) == (num_scheduler_steps > 1)
    # The requests alternate over the ranks (each added to the less loaded), so each rank
    # ran both adapters, in slots of its own.
    held = {r: set(slots._holder) - {None} for r, slots in group.adapters.slots.items()}
    assert held == {0: {1, 2}, 1: {1, 2}}
