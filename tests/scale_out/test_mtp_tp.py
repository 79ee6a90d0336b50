"""DeepSeek-V3's MTP layer as the drafter under tensor parallelism (T = 2): the layer is cut as
the target's layers are (MLA's query heads, the experts cut on F, or placed whole with expert
parallelism), inside the head's shard_map; the drafts it proposes and the tokens the engine
gives are one device's."""

from test_spec_decode_eagle import drafts_after_prefill
from test_spec_decode_mtp import save_with_mtp

from jvllm import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 41, 9], list(range(30, 50))]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 64, "max_num_seqs": 4}
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def test_mtp_at_t2_gives_one_devices_drafts_and_tokens(tmp_path):
    save_with_mtp(str(tmp_path))
    one = LLM(str(tmp_path), speculative_config=SPEC, **ENGINE)
    two = LLM(str(tmp_path), tensor_parallel_size=2, speculative_config=SPEC, **ENGINE)
    expert_parallel = LLM(
        str(tmp_path),
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        speculative_config=SPEC,
        **ENGINE,
    )
    drafts = drafts_after_prefill(one, PROMPTS[1])
    assert (
        drafts_after_prefill(two, PROMPTS[1])
        == drafts
        == drafts_after_prefill(expert_parallel, PROMPTS[1])
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    got = two.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = two.llm_engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0
