"""`LLM.chat` against HF's chat template and greedy generate on SmolLM2, and `LLM.beam_search`
against HF's beam search on the tiny random model."""

import pytest
import torch
from conftest import hf_greedy

from jvllm import LLM, BeamSearchParams, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


def test_chat_matches_hf_apply_chat_template_and_generate(smollm2_llm, hf_smollm2):
    llm = smollm2_llm
    tokenizer = llm.get_tokenizer()
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    for conversation, out in zip(CONVERSATIONS, outs):
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.prompt_token_ids == list(ids)
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, list(ids), 12)
    assert "Paris" in outs[0].outputs[0].text
    one = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_template_kwargs_reach_the_template(smollm2_llm):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ extra }}"
    params = SamplingParams(temperature=0.0, max_tokens=1)
    [out] = smollm2_llm.chat(
        CONVERSATIONS[0][:1],
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"extra": " and more"},
    )
    assert out.prompt == CONVERSATIONS[0][0]["content"] + " and more"
    # A named option given among them too: theirs wins, as in vLLM.
    template += "{% if add_generation_prompt %}>{% endif %}"
    kwargs = {"extra": "", "add_generation_prompt": False}
    [out] = smollm2_llm.chat(
        CONVERSATIONS[0][:1],
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs=kwargs,
    )
    assert out.prompt == CONVERSATIONS[0][0]["content"]


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_matches_hf_num_beams(tiny_llama_dir, tiny_llama_hf, beam_width):
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=128,
        max_num_seqs=8,
        max_model_len=256,
    )
    prompts = [
        [5, 900, 77, 12000, 3, 444, 1234, 98, 20000, 31, 7, 8, 9, 10, 11, 12, 13, 14],
        [17, 18, 19],
    ]
    max_tokens = 6
    # ignore_eos on our side and no EOS on HF's: every beam runs max_tokens, so the two
    # searches keep the same beams and rank them by the same cumulative logprob.
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            hf = tiny_llama_hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                num_beams=beam_width,
                num_return_sequences=beam_width,
                max_new_tokens=max_tokens,
                eos_token_id=None,
                pad_token_id=0,
                length_penalty=1.0,
                early_stopping=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        expected = [seq.tolist() for seq in hf.sequences]
        assert [beam.tokens for beam in out.sequences] == expected
        for beam, score in zip(out.sequences, hf.sequences_scores.tolist()):
            assert beam.cum_logprob / max_tokens == pytest.approx(score, abs=1e-4)
    # vLLM's keywords; one prompt at a time gives the same beams.
    one_at_a_time = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        lora_request=None,
        use_tqdm=False,
        concurrency_limit=1,
    )
    assert [[b.tokens for b in o.sequences] for o in one_at_a_time] == [
        [b.tokens for b in o.sequences] for o in outs
    ]
    too_long = BeamSearchParams(beam_width=beam_width, max_tokens=256)
    with pytest.raises(ValueError, match="more than max_model_len"):  # refused before any step
        llm.beam_search([prompts[1]], too_long)
