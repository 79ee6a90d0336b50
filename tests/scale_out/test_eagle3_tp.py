"""An EAGLE-3 head under tensor parallelism (T = 2, its layer cut as the target's): the drafts it
proposes and the tokens the engine gives are one device's, in single steps and in windows of
speculative rounds."""

from family_parity import save_tp_llama
from test_spec_decode_eagle import drafts_after_prefill

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.random_heads import save_random_eagle3_head
from jvllm.model_loader.hf import read_hf_config

PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50))]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 4}


def test_eagle3_at_t2_gives_one_devices_drafts_and_tokens_in_steps_and_windows(tmp_path):
    target = save_tp_llama(tmp_path / "target", 2, tie=False)
    head = str(tmp_path / "head")
    (tmp_path / "head").mkdir()
    config = read_hf_config(target, "float32")
    save_random_eagle3_head(head, config, draft_vocab_size=300, layer_ids=(0, 1, 1), seed=2)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    one = LLM(target, speculative_config=spec, **ENGINE)
    two = LLM(target, tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    assert drafts_after_prefill(two, PROMPTS[1]) == drafts_after_prefill(one, PROMPTS[1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(target, **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    got = two.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert two.llm_engine.spec_decoding_stats.num_draft_tokens > 0
    windows = LLM(
        target, tensor_parallel_size=2, speculative_config=spec, num_scheduler_steps=3, **ENGINE
    )
    got = windows.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert windows.llm_engine.spec_decoding_stats.num_draft_tokens > 0
