"""SamplingParams at vLLM parity through the whole engine: n, penalties, min_tokens, logit
processors, stop strings and ids, output kinds, metrics and validation."""

import functools
import itertools
import operator

import numpy as np
import pytest
import torch

from jvllm import LLM, RequestOutputKind, SamplingParams
from jvllm.worker.bias_rows import bad_words_token_ids

PROMPT = [(i * 7919) % 40000 + 100 for i in range(40)]  # 2 full blocks of 16 and a partial one
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(
        tiny_llama_dir,
        dtype="float32",
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_model_len=256,
    )


def _one(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_n_samples_are_reproducible_and_share_the_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = _one(llm, params)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert _one(llm, params).outputs == first.outputs
    for i, completion in enumerate(first.outputs):  # child i samples with seed + i
        alone = _one(
            llm, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True)
        )
        assert alone.outputs[0].token_ids == completion.token_ids
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1

    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    assert manager.reset_prefix_cache()
    engine.add_request("shared", PROMPT, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    engine.step()  # the three prefills run in one step
    tables = [manager.get_block_ids(f"{i}_shared") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full prompt blocks, once
    assert len({b for t in tables for b in t}) == 2 + 3  # plus one partial block per sample
    assert all(manager.block_pool.blocks[b].ref_cnt == 3 for b in tables[0][:2])
    while engine.has_unfinished_requests():
        engine.step()


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    counts = np.bincount(output, minlength=logits.size) if output else np.zeros(logits.size)
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    return logits - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("penalties", [(0.0, 0.0, 1.5), (1.5, 0.0, 1.0), (0.3, 1.0, 1.2)])
def test_greedy_with_penalties_follows_the_penalised_hf_logits(llm, tiny_llama_hf, penalties):
    presence, frequency, repetition = penalties
    prompt = [300, 301, 302, 300, 301, 302] * 3
    out = _one(
        llm,
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
        ),
        prompt,
    ).outputs[0]
    tokens = []
    for token in out.token_ids:
        with torch.inference_mode():
            logits = tiny_llama_hf(torch.tensor([prompt + tokens])).logits[0, -1].numpy()
        penalised = _reference_penalties(logits.astype(np.float64), prompt, tokens, *penalties)
        assert token == int(np.argmax(penalised))
        tokens.append(token)


def test_min_tokens_suppresses_eos_and_stop_ids(llm):
    out = _one(
        llm, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, logit_bias={EOS: 100.0})
    ).outputs[0]
    assert out.token_ids == out.token_ids[:4] + [EOS] and EOS not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    ref = _one(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).outputs[0]
    stop_id = ref.token_ids[0]
    out = _one(
        llm,
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            min_tokens=3,
            stop_token_ids=[stop_id],
            logit_bias={stop_id: 50.0},
        ),
    ).outputs[0]
    assert stop_id not in out.token_ids[:3] and out.token_ids[3] == stop_id
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_allowed_token_ids_logit_bias_and_bad_words(llm):
    allowed = [1000, 2000, 3000, 4000]
    out = _one(
        llm,
        SamplingParams(
            temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed
        ),
    ).outputs[0]
    assert set(out.token_ids) <= set(allowed)
    out = _one(
        llm, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={777: 100.0})
    ).outputs[0]
    assert out.token_ids == [777] * 3
    tokenizer = llm.get_tokenizer()
    banned = bad_words_token_ids(tokenizer, ["hello"])
    assert all(len(seq) == 1 for seq in banned)  # "hello" and " hello"
    boost = {seq[0]: 100.0 for seq in banned}
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "logit_bias": boost}
    assert _one(llm, SamplingParams(**params)).outputs[0].token_ids[0] in boost
    out = _one(llm, SamplingParams(bad_words=["hello"], **params)).outputs[0]
    assert not set(out.token_ids) & set(boost)
    # A two-token bad word: its last token is banned right after its first, and only there.
    ((first, second),) = bad_words_token_ids(tokenizer, ["homelessness"])
    params = {
        "temperature": 50.0,
        "max_tokens": 30,
        "ignore_eos": True,
        "allowed_token_ids": [first, second],
    }

    def has_pair(tokens):
        return any(a == first and b == second for a, b in itertools.pairwise(tokens))

    def outputs(**extra):
        # Eight seeds: a sequence that has drawn `first` can no longer draw `second` when the
        # word is banned, so `second` shows only in sequences that drew it before any `first`.
        batch = [SamplingParams(seed=seed, **params, **extra) for seed in range(8)]
        return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 8, batch, use_tqdm=False)]

    assert any(has_pair(tokens) for tokens in outputs())
    banned_outputs = outputs(bad_words=["homelessness"])
    assert not any(has_pair(tokens) for tokens in banned_outputs)
    assert any(second in tokens for tokens in banned_outputs)


def test_stop_strings_split_across_tokens(llm):
    ref = _one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)).outputs[0]
    tokenizer = llm.get_tokenizer()
    pieces = [tokenizer.decode([t]) for t in ref.token_ids]
    k = next(
        i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    start = ref.text.index(stop)
    for include in (False, True):
        out = _one(
            llm,
            SamplingParams(
                temperature=0.0,
                max_tokens=16,
                ignore_eos=True,
                stop=["never-there", stop],
                include_stop_str_in_output=include,
            ),
        ).outputs[0]
        assert out.text == ref.text[: start + (len(stop) if include else 0)]
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_wait_for_min_tokens(llm):
    """As vLLM: a stop string ends a request only past min_tokens, and one wholly inside the
    first min_tokens tokens' text is not found later."""
    ref = _one(llm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)).outputs[0]
    tokenizer = llm.get_tokenizer()
    early = tokenizer.decode(ref.token_ids[1:2])  # the second token's text
    assert early.strip() and early not in tokenizer.decode(ref.token_ids[:1])
    params = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "stop": [early]}
    stopped = _one(llm, SamplingParams(**params)).outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 2
    held = _one(llm, SamplingParams(**params, min_tokens=6)).outputs[0]
    later = ref.text.find(early, len(tokenizer.decode(ref.token_ids[:6])))
    if later == -1:
        assert held.token_ids == ref.token_ids and held.finish_reason == "length"
    else:
        assert held.finish_reason == "stop" and held.text == ref.text[:later]


def test_delta_outputs_add_up_to_the_cumulative_ones(llm):
    engine = llm.llm_engine
    base = {
        "temperature": 0.0,
        "max_tokens": 10,
        "ignore_eos": True,
        "logprobs": 2,
        "stop": ["zzzz"],
    }
    engine.add_request("delta", PROMPT, SamplingParams(output_kind=RequestOutputKind.DELTA, **base))
    engine.add_request("cum", PROMPT, SamplingParams(**base))
    outs = {"delta": [], "cum": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    final = outs["cum"][-1].outputs[0]
    deltas = [o.outputs[0] for o in outs["delta"]]
    assert "".join(d.text for d in deltas) == final.text
    assert functools.reduce(operator.iadd, (d.token_ids for d in deltas), []) == final.token_ids
    assert functools.reduce(operator.iadd, (d.logprobs for d in deltas), []) == final.logprobs
    # Running outputs hold back len("zzzz") - 1 characters: a stop string may start there.
    for o in outs["cum"][:-1]:
        assert final.text.startswith(o.outputs[0].text)
    metrics = outs["cum"][-1].metrics
    assert (
        metrics.arrival_time
        <= metrics.first_scheduled_time
        <= metrics.first_token_time
        <= metrics.last_token_time
        <= metrics.finished_time
    )


def test_final_only_reports_once_and_skip_detokenize(llm):
    engine = llm.llm_engine
    engine.add_request(
        "final",
        PROMPT,
        SamplingParams(
            max_tokens=5, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY, logprobs=1
        ),
    )
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].text == ""
    assert all(lp.decoded_token is None for e in outs[0].outputs[0].logprobs for lp in e.values())


def test_aborting_a_parent_aborts_its_samples(llm):
    engine = llm.llm_engine
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    engine.add_request("p", PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("p")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == free
    # A list naming an id twice, or a parent with one of its samples, aborts each once.
    engine.add_request("q", PROMPT, SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request(["r", "r", "q", "0_q", "unknown"])
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == free


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"n": 0}, "n must"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"output_kind": 7}, "output_kind"),
        ({"stop": ["x"], "detokenize": False}, "detokenize"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logit_bias": {49152: 1.0}}, r"logit_bias token ids must be in \[0, 49152\)"),
        ({"allowed_token_ids": [1, 50000]}, r"allowed_token_ids token ids must be in \[0, 49152\)"),
        ({"logprobs": 21}, r"logprobs must be in \[0, max_logprobs=20\]"),
    ],
)
def test_model_dependent_checks_reject_at_add_request(llm, kwargs, match):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", PROMPT, SamplingParams(**kwargs))
    assert not engine.has_unfinished_requests()


def test_two_stop_strings_in_one_token_end_at_the_first_listed():
    from jvllm.engine.output_processor import _find_stop

    # A token "abc" completes both: vLLM takes the first stop in the request's list.
    assert _find_stop("xxabc", 3, ["c", "a"]) == ("c", 4)
    assert _find_stop("xxabc", 3, ["a", "c"]) == ("a", 2)
    assert _find_stop("xxabc", 3, ["x"]) is None  # before the new text
