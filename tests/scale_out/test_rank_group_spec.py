"""Speculative decoding in a group of data-parallel ranks whose MoE layers run across them
(worker/rank_group.py, D = 2 on fake CPU devices): n-gram drafts, a draft model and an MTP or
EAGLE head drafting inside every rank's step, alone or in windows of speculative rounds, give
one device's tokens without speculation; an EAGLE-1 or EAGLE-3 head's drafts at T = 2 are one
device's."""

import pytest
from family_parity import ragged_prompts
from test_data_parallel_moe import ENGINE_KWARGS, VOCAB, group_llm, model_dir
from test_spec_decode_mtp import save_with_mtp

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.random_heads import save_random_eagle1_head, save_random_eagle3_head
from jvllm.model_loader.hf import read_hf_config

__all__ = ["model_dir"]  # the fixture, shared with test_data_parallel_moe.py


def _speculating_ranks_give_one_devices_tokens(
    path: str, spec: dict, t: int = 1, num_scheduler_steps: int = 1, **options
) -> LLM:
    """Greedy and seeded requests over two ranks that speculate as `spec` says (in windows of
    rounds with `num_scheduler_steps` > 1: every rank's rounds in one call, going on while
    any rank's row does) give the tokens of one device without speculation, and both ranks
    accept drafts. -> the group's LLM."""
    prompts = ragged_prompts(VOCAB, lengths=(6, 13, 9, 20))
    params = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True),
    ]

    def run(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    expected = run(LLM(path, **ENGINE_KWARGS))
    llm = group_llm(
        path, t, speculative_config=spec, num_scheduler_steps=num_scheduler_steps, **options
    )
    assert run(llm) == expected
    stats = [engine.spec_decoding_stats for engine in llm.llm_engine.replicas]
    assert all(s.num_accepted_tokens > 0 for s in stats)  # both ranks' drafts verified
    group = llm.llm_engine.group.group_runner()
    if num_scheduler_steps > 1:  # windows ran, and steps where a rank prefilled
        assert 0 < group.num_windows < group.num_group_steps
    return llm


@pytest.mark.parametrize(("t", "num_scheduler_steps"), [(1, 1), (2, 1), (1, 4)])
def test_ranks_verify_ngram_drafts_and_give_the_tokens_of_no_speculation(
    model_dir, t, num_scheduler_steps
):
    """speculative_config's n-gram drafts in the group: each rank's scheduler looks drafts up
    for its own requests and the group's one step verifies them all (a Mixtral whose
    attention is scaled down, so that its continuations loop while the context still steers
    them)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec["prompt_lookup_min"] = 1
    _speculating_ranks_give_one_devices_tokens(
        model_dir("looping_mixtral"), spec, t, num_scheduler_steps
    )


@pytest.mark.parametrize(("t", "num_scheduler_steps"), [(1, 1), (2, 1), (1, 4)])
def test_ranks_draft_with_a_draft_model_and_give_the_tokens_of_no_speculation(
    model_dir, t, num_scheduler_steps
):
    """speculative_config's draft model in the group: every rank's step runs the draft (a
    Mixtral, its experts across the ranks as the target's, cut over T with its layers) over
    its rows and its own draft pages, and proposes k drafts a sequence that its scheduler
    hands back next step (the target as its own draft)."""
    path = model_dir("looping_mixtral")
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    _speculating_ranks_give_one_devices_tokens(path, spec, t, num_scheduler_steps)


@pytest.mark.parametrize(
    ("t", "num_scheduler_steps", "all2all_backend"),
    [(1, 1, "auto"), (2, 1, "auto"), (1, 4, "ragged_all_to_all")],
)
def test_ranks_draft_with_the_mtp_layer_and_give_the_tokens_of_no_speculation(
    tmp_path, t, num_scheduler_steps, all2all_backend
):
    """DeepSeek-V3's MTP layer as the group's draft head (the deployment of data-parallel
    attention with the experts over every device): its MoE layer's experts placed over the
    ranks as the target's, exchanging tokens in each of its draft steps; at T = 2 its heads
    cut over the rank's devices and its LM head's logits gathered; its MoE layer exchanges
    tokens as the target's do (the all2all_backend chosen for it)."""
    save_with_mtp(str(tmp_path))
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = _speculating_ranks_give_one_devices_tokens(
        str(tmp_path), spec, t, num_scheduler_steps, all2all_backend=all2all_backend
    )
    group = llm.llm_engine.group.group_runner()
    assert group.draft.config.all2all_backend == group.config.all2all_backend
    if all2all_backend != "auto":
        assert group.draft.config.all2all_backend == all2all_backend


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_at_t2_proposes_one_devices_drafts(model_dir, tmp_path, method):
    """An EAGLE-1 head reads the target's LM head, an EAGLE-3 head its own over a draft
    vocabulary (301 ids, padded to cut over T): either cut on the vocabulary over the rank's
    two devices inside the group's shard_map, its logits (and EAGLE-3's d2t) gathered whole,
    the drafts it proposes for a request on rank 0 are one engine's, and the tokens one
    device's without speculation."""
    path = model_dir("looping_mixtral")
    target = read_hf_config(path, "float32")
    if method == "eagle":
        save_random_eagle1_head(str(tmp_path), target, seed=7)
    else:
        save_random_eagle3_head(
            str(tmp_path), target, draft_vocab_size=301, layer_ids=(0, 1, 1), seed=7
        )
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3}

    def drafts_after_prefill(engine, ranks) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request("probe", {"prompt_token_ids": list(range(30, 50))}, params)
        engine.step()
        _, drafts = ranks[0].scheduler.drafter._proposals["probe"]
        engine.abort_request("probe")
        return drafts

    one = LLM(path, speculative_config=spec, **ENGINE_KWARGS).llm_engine
    group = group_llm(path, 2, speculative_config=spec)
    want = drafts_after_prefill(one, [one])
    assert (
        len(want) == 3 and drafts_after_prefill(group.llm_engine, group.llm_engine.replicas) == want
    )
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(VOCAB, lengths=(6, 13, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = lambda llm: [
        o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
    ]
    assert tokens(group) == tokens(LLM(path, **ENGINE_KWARGS))
