"""Logprobs and prompt logprobs against HF transformers' log-softmax of the same logits."""

import numpy as np
import pytest
import torch

from jvllm import LLM, BeamSearchParams, SamplingParams

PROMPT = [5, 900, 77, 12000, 3, 444, 1234, 98, 20000, 31, 7, 8, 9, 10, 11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=256,
    )


def _hf_logprobs(model, token_ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()  # [len, V]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_logprobs_match_hf_log_softmax(llm, tiny_llama_hf, temperature):
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=6, ignore_eos=True, logprobs=5
    )
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    ref = _hf_logprobs(tiny_llama_hf, PROMPT + out.token_ids)
    assert len(out.logprobs) == 6
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        top5 = np.argsort(-row)[:5]
        assert next(iter(entry)) == token  # the sampled token comes first
        assert set(entry) == set(top5.tolist()) | {token}
        for token_id, lp in entry.items():
            assert abs(lp.logprob - row[token_id]) < 1e-4
            assert lp.rank == int((row >= row[token_id]).sum())
            assert lp.decoded_token == llm.get_tokenizer().decode([token_id])
        total += row[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_prompt_logprobs_match_hf_even_when_chunked(tiny_llama_dir, tiny_llama_hf):
    # A 10-token prefill budget splits the prompt across steps.
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=8,
        max_model_len=256,
        long_prefill_token_threshold=10,
    )
    out = llm.generate(
        [PROMPT, PROMPT[:7]],
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
        use_tqdm=False,
    )
    for prompt, result in zip([PROMPT, PROMPT[:7]], out):
        ref = _hf_logprobs(tiny_llama_hf, prompt)
        assert result.prompt_logprobs[0] is None
        assert len(result.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entry = result.prompt_logprobs[position]
            row = ref[position - 1]
            assert prompt[position] in entry
            assert set(entry) == set(np.argsort(-row)[:3].tolist()) | {prompt[position]}
            for token_id, lp in entry.items():
                assert abs(lp.logprob - row[token_id]) < 1e-4
        assert result.outputs[0].logprobs is None and result.outputs[0].cumulative_logprob is None


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0), use_tqdm=False
    )[0].outputs[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]


def test_logprobs_above_max_logprobs_are_rejected(llm):
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([PROMPT], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=50), use_tqdm=False)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode_gives_vllms_values(tiny_llama_dir, tiny_llama_hf, llm, mode):
    """The tokens are the same in every mode; the values are HF's logits, or the log-softmax
    (or the logits) of what the sampler drew from: over the temperature, past top-k -inf."""
    params = SamplingParams(
        temperature=0.8, top_k=5, seed=3, max_tokens=4, ignore_eos=True, logprobs=5
    )
    raw = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    moded = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, logprobs_mode=mode)
    prompt_params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    out = moded.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == raw.token_ids
    with torch.inference_mode():
        logits = tiny_llama_hf(torch.tensor([PROMPT + out.token_ids])).logits[0].float().numpy()
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logits[len(PROMPT) - 1 + i]
        top5 = np.argsort(-row)[:5]
        if mode == "raw_logits":
            expected = row
        else:
            scaled = row[top5] / 0.8
            expected = np.full_like(row, -np.inf)
            expected[top5] = scaled
            if mode == "processed_logprobs":
                expected[top5] = (
                    scaled - np.log(np.sum(np.exp(scaled - scaled.max()))) - scaled.max()
                )
        assert set(entry) == set(top5.tolist()) | {token}
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[tid], abs=1e-3)
    # A prompt is sampled by nothing: its values are of the raw logits in every mode.
    [prompt_out] = moded.generate([PROMPT], prompt_params, use_tqdm=False)
    position = prompt_out.prompt_logprobs[3]
    reference = logits[2] if mode.endswith("logits") else _hf_logprobs(tiny_llama_hf, PROMPT)[2]
    assert position[PROMPT[3]].logprob == pytest.approx(reference[PROMPT[3]], abs=1e-3)
    if mode.endswith("_logits"):  # beam search ranks by logprobs
        with pytest.raises(ValueError, match="logprobs_mode"):
            moded.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2))


def test_an_unknown_logprobs_mode_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(tiny_llama_dir, logprobs_mode="final_logprobs")
