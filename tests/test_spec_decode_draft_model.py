"""Speculative decoding with a draft model (speculative_config method "draft_model"): greedy
float32 and seeded sampled requests get exactly the tokens they get without speculation, a
draft equal to the target has its drafts accepted, and a draft of another vocabulary is refused.
"""

import functools

import pytest
import test_spec_decode as ngram_tests
import transformers
from family_parity import TINY_SHAPES, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.core import KVCacheManager, Request, Scheduler, SchedulerConfig
from jvllm.core.spec_decode import DraftProposer
from jvllm.engine.arg_utils import EngineArgs
from jvllm.model_loader.hf import read_hf_config
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.worker.kv_budget import MemoryProbe, size_kv_cache
from jvllm.worker.kv_layout import kv_cache_spec

ENGINE_KWARGS, PROMPTS = ngram_tests.ENGINE_KWARGS, ngram_tests.PROMPTS
# The n-gram tests' fixtures: a tiny random Llama whose greedy continuations loop, and it plain.
looping_model_dir, plain_llm = ngram_tests.looping_model_dir, ngram_tests.plain_llm


def draft_model(path: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **extra}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """A one-layer random Llama of the target's vocabulary: its drafts are mostly wrong."""
    path = str(tmp_path_factory.mktemp("draft_llama"))
    shapes = {**TINY_SHAPES, "num_hidden_layers": 1}
    save_random_model(path, transformers.LlamaConfig(**shapes, tie_word_embeddings=False), seed=3)
    return path


def _batch():
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.2, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
    return [*PROMPTS, PROMPTS[1]], [greedy] * len(PROMPTS) + [seeded]


def test_the_target_as_its_own_draft_gives_the_same_tokens_and_is_accepted(
    looping_model_dir, plain_llm
):
    """Greedy requests over chunked prefill, then seeded sampled ones, then both: the target
    drafting for itself is right at every position, greedy and sampled."""
    llm = LLM(looping_model_dir, speculative_config=draft_model(looping_model_dir), **ENGINE_KWARGS)
    prompts, params = _batch()
    greedy = params[: len(PROMPTS)]
    assert _tokens(llm, PROMPTS, greedy) == _tokens(plain_llm, PROMPTS, greedy)
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > 20
    assert stats.acceptance_rate > 0.95
    # Sampled requests' drafts are drawn with the uniforms their target draws with: a draft
    # equal to the target agrees at every position (argmax drafts: 3% here, on this random
    # model's flat distributions).
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    sampled = [
        SamplingParams(temperature=0.7, seed=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=2, top_p=0.9, max_tokens=24, ignore_eos=True),
        params[-1],  # temperature 1.2, top-k 50
        # The draft's logits take the request's bias row too (1 of 60 accepted without it).
        SamplingParams(
            temperature=1.0, seed=3, logit_bias={5: 5.0}, max_tokens=24, ignore_eos=True
        ),
    ]
    assert _tokens(llm, prompts[:4], sampled) == _tokens(plain_llm, prompts[:4], sampled)
    rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts)
    assert rate > 0.95, rate
    # Its penalties too, over the history and the drafts before each (0.53 without them).
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    penalized = [
        SamplingParams(temperature=0.8, seed=4, max_tokens=24, ignore_eos=True, **penalties)
        for penalties in (
            {"repetition_penalty": 1.8},
            {"frequency_penalty": 1.5, "presence_penalty": 0.5},
            {"repetition_penalty": 1.3, "frequency_penalty": 0.7},
        )
    ]
    assert _tokens(llm, prompts[:3], penalized) == _tokens(plain_llm, prompts[:3], penalized)
    rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts)
    assert rate > 0.95, rate
    assert _tokens(llm, prompts, params) == _tokens(plain_llm, prompts, params)


@pytest.mark.slow
def test_another_draft_gives_the_same_tokens(looping_model_dir, plain_llm, other_draft_dir):
    """A one-layer draft that rarely agrees, in a KV cache small enough to preempt."""
    llm = LLM(
        looping_model_dir,
        speculative_config=draft_model(other_draft_dir, k=2),
        num_gpu_blocks_override=14,
        **ENGINE_KWARGS,
    )
    prompts, params = _batch()
    assert _tokens(llm, prompts, params) == _tokens(plain_llm, prompts, params)
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 0
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_draft_model_options_are_checked(looping_model_dir):
    with pytest.raises(ValueError, match="method 'draft_model' needs model"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="are for methods \\('draft_model', .*\\), not 'ngram'"):
        EngineArgs(speculative_config={**draft_model("x"), "method": "ngram"})
    with pytest.raises(ValueError, match="speculative_config does not run with"):
        EngineArgs(speculative_config=draft_model("x"), async_scheduling=True)


def test_a_draft_of_another_vocabulary_is_refused(looping_model_dir, tmp_path):
    shapes = {**TINY_SHAPES, "num_hidden_layers": 1, "vocab_size": 640}
    save_random_model(str(tmp_path), transformers.LlamaConfig(**shapes))
    with pytest.raises(ValueError, match="vocabulary of 640 tokens, the target 512"):
        LLM(looping_model_dir, speculative_config=draft_model(str(tmp_path)), **ENGINE_KWARGS)


def test_a_draft_models_proposals_get_lookahead_slots_and_serve_their_length_only():
    """The prefill and each verify step allocate k slots past the request's tokens (and
    drafts) for the draft's KV at the positions it proposes; a proposal serves the request
    only while it has the length the proposal was made for."""
    config = SpeculativeConfig(3, 5, 5, method="draft_model", model="draft")
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
        KVCacheManager(num_blocks=32, block_size=4),
        DraftProposer(config, max_model_len=64),
    )
    params = SamplingParams(temperature=0, max_tokens=16)
    request = Request("r", [1, 2, 3, 4], params, eos_token_id=None)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert len(output.block_ids["r"]) == 2  # 4 tokens and 3 lookahead slots
    scheduler.update_from_output(output, {"r": 9})
    scheduler.drafter.set_proposals({"r": (request.num_tokens, [7, 8, 6])})
    output = scheduler.schedule()
    assert output.spec_token_ids == {"r": [7, 8, 6]}
    assert len(output.block_ids["r"]) == 3  # positions up to 4 + 3 drafts + 3 lookahead
    scheduler.update_from_output(output, {"r": [7, 5]})
    scheduler.drafter.set_proposals({"r": (request.num_tokens - 1, [1, 1, 1])})  # stale
    assert scheduler.schedule().spec_token_ids == {}


def test_the_kv_budget_counts_both_models_bytes_a_block(looping_model_dir):
    config = read_hf_config(looping_model_dir, "float32")
    engine_config = EngineArgs(kv_cache_memory_bytes=1 << 20).create_engine_config()
    spec = kv_cache_spec("float32", "reference")
    probe = MemoryProbe("cpu", None, "")
    size = functools.partial(
        size_kv_cache, engine_config.cache_config, engine_config.runner_config, config, spec
    )
    alone, with_draft = size(512, probe), size(512, probe, draft_config=config)
    assert with_draft.num_blocks == alone.num_blocks // 2


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_window_row_cut_at_min_tokens_does_not_start_on_its_cut_runs_drafts(
    temperature, looping_model_dir
):
    """The target drafting for itself in windows of speculative rounds: after its prefill the
    request may take 9 tokens to reach min_tokens, two whole runs of 4 and 1 of its third
    round's. That round's draft proposed from after all 4, for output indices 13..15, so the
    request, which goes on at index 10, must not start its next window with those drafts."""
    llm = LLM(
        looping_model_dir,
        speculative_config=draft_model(looping_model_dir),
        num_scheduler_steps=4,
        **ENGINE_KWARGS,
    )
    params = SamplingParams(
        temperature=temperature, seed=3, min_tokens=10, max_tokens=24, ignore_eos=True
    )
    _tokens(llm, PROMPTS[:1], [params])
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > 12
    assert stats.num_accepted_tokens == stats.num_draft_tokens
