"""Speculative decoding with a draft model over the mesh: at T = 2 the draft is sharded as the
target is (its KV heads and vocabulary split, its KV cache over the same pages), and the
greedy tokens equal one device's without speculation."""

from family_parity import save_tp_llama

from jvllm import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50))]


def test_draft_model_at_t2_gives_one_devices_tokens(tmp_path):
    target = save_tp_llama(tmp_path / "target", 2, tie=False)
    draft = save_tp_llama(tmp_path / "draft", 2, tie=True)  # another random model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 4}
    want = LLM(target, **engine).generate(PROMPTS, params, use_tqdm=False)
    for model in (target, draft):
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
        llm = LLM(target, tensor_parallel_size=2, speculative_config=spec, **engine)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        stats = llm.llm_engine.spec_decoding_stats
        assert stats.num_draft_tokens > 0
        if model == target:
            assert stats.acceptance_rate == 1.0


def test_ngram_windows_at_t2_give_one_devices_tokens(tmp_path):
    """n-gram drafts in windows of 4 rounds, the later rounds' looked up on the device over
    the token cache, which every device holds whole."""
    target = save_tp_llama(tmp_path / "target", 2, tie=False)
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], list(range(30, 50))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 4}
    want = LLM(target, **engine).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(
        target, tensor_parallel_size=2, speculative_config=spec, num_scheduler_steps=4, **engine
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
