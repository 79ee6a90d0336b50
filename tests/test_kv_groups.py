"""Hybrid KV groups (core/kv_groups.py): the layers' grouping, windowed groups freeing the
blocks their window passed, prefix hits across groups, and a windowed model through the engine
giving the tokens it gives with every page kept."""

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from family_parity import TINY_SHAPES, hf_greedy_ignoring_eos, ragged_prompts, save_random_model

from jvllm import LLM, SamplingParams
from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.kv_groups import blocks_to_hold, kv_cache_groups
from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from jvllm.sampling_params import SamplingParams as Params
from jvllm.step_loop import StepLoop

B = 4  # block size
W = 8  # window


def test_gemma3s_pattern_makes_one_full_group_and_five_windowed():
    windows = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(12))
    groups = kv_cache_groups(windows)
    assert groups.windows == (None,) + (1024,) * 5
    assert groups.num_slots == 2
    assert groups.layer_group[5] == groups.layer_group[11] == 0
    assert [groups.layer_slot[i] for i in (5, 11)] == [0, 1]
    # Every (group, slot) holds one layer.
    assert len(set(zip(groups.layer_group, groups.layer_slot))) == 12


def test_an_uneven_split_pads_the_last_windowed_group():
    windows = (None, 16, 16, 16, None, 16)  # 2 full, 4 windowed: slots of 2
    groups = kv_cache_groups(windows)
    assert groups.windows == (None, 16, 16)
    assert groups.layer_group == (0, 1, 1, 2, 0, 2)
    windows = (None, 16, 16, None, 16)  # 2 full, 3 windowed: the last group half used
    assert kv_cache_groups(windows).windows == (None, 16, 16)


@pytest.mark.parametrize(
    ("windows", "enable", "kept"),
    [((None, None), True, None), ((8, 16, 8), True, 16), ((None, 8), False, None)],
    ids=["global", "all windowed", "disabled"],
)
def test_one_kind_of_layer_or_disabled_is_one_group(windows, enable, kept):
    groups = kv_cache_groups(windows, enable)
    assert groups.windows == (kept,)  # all windowed: the widest
    assert groups.layer_slot == tuple(range(len(windows)))


def _manager(num_blocks=64, prefix_caching=True) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, prefix_caching, groups=kv_cache_groups((None, W)))


def _prefill_in_chunks(kv: KVCacheManager, request: Request, chunk: int) -> None:
    hits, num_hit = kv.get_computed_blocks(request)
    request.num_computed_tokens = 0
    first = min(chunk, request.num_tokens - num_hit)
    assert kv.allocate_slots(request, first, hits, num_hit) is not None
    request.num_computed_tokens = num_hit + first
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n


def test_a_windowed_group_keeps_only_its_windows_blocks():
    kv = _manager()
    request = Request("a", list(range(100)), Params(), eos_token_id=None)
    _prefill_in_chunks(kv, request, chunk=8)
    assert kv.allocate_slots(request, 1) is not None  # the first decode step
    (window_ids,) = kv.get_window_block_ids("a")
    full_ids = kv.get_block_ids("a")
    assert len(window_ids) == len(full_ids) == 26
    # The query at 100 sees 93..100: blocks 23.. of 4 tokens.
    assert window_ids[:23] == [0] * 23 and 0 not in window_ids[23:]
    assert kv.num_usable_blocks - kv.num_free_blocks == 26 + 3
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_prefix_hit_takes_the_windowed_groups_blocks_from_its_window_on():
    kv = _manager()
    prompt = list(range(40))
    first = Request("a", prompt, Params(), eos_token_id=None)
    _prefill_in_chunks(kv, first, chunk=8)
    kv.free(first)
    again = Request("b", prompt + [7], Params(), eos_token_id=None)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40
    assert kv.allocate_slots(again, 1, hits, num_hit) is not None
    (window_ids,) = kv.get_window_block_ids("b")
    # The query at 40 sees 33..40: the windowed group's blocks 8 and 9, the others null.
    assert window_ids[:8] == [0] * 8 and 0 not in window_ids[8:]
    kv.free(again)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_hit_shortens_to_where_the_windowed_group_still_holds():
    kv = _manager()
    prompt = list(range(40))
    first = Request("a", prompt, Params(), eos_token_id=None)
    _prefill_in_chunks(kv, first, chunk=40)
    (window_table,) = kv.req_to_window_blocks["a"]
    kv.free(first)
    kv.block_pool.uncache(window_table[9])  # as if evicted: the last block's windowed KV
    again = Request("b", prompt + [7], Params(), eos_token_id=None)
    # 40 tokens would need windowed blocks 8, 9; 36 need 7, 8, still cached.
    assert kv.get_computed_blocks(again)[1] == 36
    kv.block_pool.uncache(window_table[7])
    assert kv.get_computed_blocks(again)[1] == 28  # blocks 5, 6 for a hit of 28


@pytest.mark.parametrize("penalized", [False, True])
def test_all_windowed_layers_free_blocks_unless_the_request_reads_its_history(penalized):
    kv = KVCacheManager(64, B, True, groups=kv_cache_groups((W, W)))
    params = Params(repetition_penalty=1.2 if penalized else 1.0)
    request = Request("a", list(range(40)), params, eos_token_id=None)
    _prefill_in_chunks(kv, request, chunk=8)
    assert kv.allocate_slots(request, 1) is not None
    table = kv.get_block_ids("a")
    assert len(table) == 11
    # The query at 40 sees 33..40: blocks 8.. (penalties read every token: all blocks).
    assert table.count(0) == (0 if penalized else 8)
    kv.free(request)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_never_fits_counts_the_window_not_the_whole_prompt():
    groups = kv_cache_groups((None, W))
    assert blocks_to_hold(groups, 400, B, max_step_tokens=16) == 100 + 7
    assert blocks_to_hold(None, 400, B, max_step_tokens=16) == 100
    windowed = kv_cache_groups((W, W))
    assert blocks_to_hold(windowed, 400, B, 16, keeps_history=False) == 7
    assert blocks_to_hold(windowed, 400, B, 16, keeps_history=True) == 100


# --- through the engine ---------------------------------------------------------------

TINY = {**TINY_SHAPES, "num_hidden_layers": 4, "head_dim": 16, "attn_implementation": "eager"}


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2")
    hf_model = save_random_model(path, transformers.Gemma2Config(**TINY, sliding_window=W))
    return str(path), hf_model


def _long_prompts() -> list[list[int]]:
    """Past the window many times, and one short of it."""
    return ragged_prompts(TINY["vocab_size"], lengths=(5, 30, 63, 90, 181))


def _run(path: str, prompts, sampling: dict | None = None, **kwargs):
    """Greedy tokens, and each one's logprob (the random model repeats its tokens, whose
    logprobs still follow every position's attention), and the engine's KV cache manager;
    `sampling`: more SamplingParams fields."""
    llm = LLM(path, dtype="float32", max_model_len=256, **{"block_size": B, **kwargs})
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, **(sampling or {})
    )
    outputs = [
        o.outputs[0]
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    logprobs = [[lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] for o in outputs]
    kv = llm.llm_engine.scheduler.kv_cache_manager
    return [o.token_ids for o in outputs], np.asarray(logprobs), kv


def test_windowed_layers_free_their_pages_and_decode_the_same(gemma2):
    """Chunked prefill and decode windows, the blocks held at the end of a long prompt's
    prefill, and the tokens, against the same engine keeping every page."""
    path, hf_model = gemma2
    kwargs = {"max_num_batched_tokens": 32, "num_scheduler_steps": 4}
    prompts = _long_prompts()
    kept, kept_logprobs, kept_kv = _run(
        path, prompts, disable_hybrid_kv_cache_manager=True, **kwargs
    )
    hybrid, logprobs, kv = _run(path, prompts, **kwargs)
    assert hybrid == kept == [hf_greedy_ignoring_eos(hf_model, p, 12) for p in prompts]
    np.testing.assert_allclose(logprobs, kept_logprobs, atol=1e-4)
    assert kv.windows == (W,) and kept_kv.windows == ()
    longest = max(prompts, key=len)
    request = Request("long", longest, Params(max_tokens=1), eos_token_id=None)
    _prefill_in_chunks(kv, request, chunk=32)
    kv.allocate_slots(request, 1)
    num_full = len(kv.get_block_ids("long"))
    (window_ids,) = kv.get_window_block_ids("long")
    assert sum(1 for b in window_ids if b) <= -(-W // B) + 1
    assert len(window_ids) == num_full
    kv.free(request)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """Every layer windowed."""
    path = tmp_path_factory.mktemp("mistral")
    hf_model = save_random_model(path, transformers.MistralConfig(**TINY, sliding_window=W))
    return str(path), hf_model


def test_all_windowed_layers_free_their_pages_and_decode_the_same(mistral):
    """Mistral v0.1's kind: one windowed group frees pages, except a request with penalties."""
    path, hf_model = mistral
    prompts = _long_prompts()
    kept, kept_logprobs, _ = _run(path, prompts, disable_hybrid_kv_cache_manager=True)
    freed, logprobs, kv = _run(path, prompts)
    assert freed == kept == [hf_greedy_ignoring_eos(hf_model, p, 12) for p in prompts]
    np.testing.assert_allclose(logprobs, kept_logprobs, atol=1e-4)
    assert kv.first_window == W
    penalized = {"repetition_penalty": 1.3, "presence_penalty": 0.5}
    assert (
        _run(path, prompts, penalized)[0]
        == _run(path, prompts, penalized, disable_hybrid_kv_cache_manager=True)[0]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {"async_scheduling": True},
        {"num_gpu_blocks_override": 72, "max_num_batched_tokens": 32},  # preempts
        {"enable_prefix_caching": True, "max_num_batched_tokens": 16},
        {"kv_cache_dtype": "int8"},
        {"attention_backend": "pallas", "block_size": 8},  # interpreted kernels, pages of 8
    ],
    ids=["async", "preemption", "prefix hits in chunks", "int8 KV", "pallas"],
)
def test_windowed_layers_decode_the_same_under(gemma2, kwargs):
    prompts = _long_prompts()
    prompts = prompts + [prompts[0] + [5, 6, 7]]  # a prefix hit on the first
    kept, kept_logprobs, _ = _run(
        gemma2[0], prompts, disable_hybrid_kv_cache_manager=True, **kwargs
    )
    hybrid, logprobs, _ = _run(gemma2[0], prompts, **kwargs)
    assert hybrid == kept
    np.testing.assert_allclose(logprobs, kept_logprobs, atol=1e-4)


@pytest.mark.slow
def test_a_step_loop_decodes_over_every_groups_tables(gemma2):
    llm = LLM(gemma2[0], dtype="float32", max_model_len=256, block_size=B)
    prompts = _long_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    loop = StepLoop(llm)
    state = loop.prefill(prompts, params)
    call = loop.jit(lambda state: loop.step(state))
    tokens, active = [], []
    for _ in range(8):
        state, out = call(state)
        tokens.append(out.token_ids)
        active.append(out.active)
    looped = loop.finish(state, jnp.stack(tokens), jnp.stack(active))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert looped == [o.outputs[0].token_ids for o in outputs]


def test_an_all_windowed_prefix_hit_takes_only_its_windows_blocks():
    """A hit on a prompt that filled most of the pool: the request takes the blocks from its
    window on (holding every hit block, more than the window the never-fits check counted, it
    waited at the head of the queue for blocks that never came)."""
    kv = KVCacheManager(16, B, True, groups=kv_cache_groups((W, W)))
    scheduler = Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=24), kv)
    prompt = list(range(40))  # 10 blocks of the 15, each freed as the window passed it
    for request_id, tokens in (("a", prompt), ("b", prompt + list(range(100, 124)))):
        request = Request(request_id, tokens, Params(max_tokens=1), eos_token_id=None)
        scheduler.add_request(request)
        for _ in range(10):
            output = scheduler.schedule()
            if request_id == "b" and not request.num_output_tokens:  # its first step: the hit
                assert output.num_scheduled_tokens == {"b": 24}
                # The query at 40 sees 33..: blocks 8.. (the others never taken).
                table = kv.req_to_blocks["b"]
                assert [b.block_id for b in table[:8]] == [0] * 8
                assert all(b.block_id for b in table[8:])
                # Its fresh blocks are registered after the hit's, as any request's.
                assert all(block.cache_id is not None for block in table[8:])
            scheduler.update_from_output(
                output, {r.request_id: 1 for r in output.scheduled_requests}
            )
            if request.is_finished:
                break
        assert request.is_finished
    assert kv.num_free_blocks == kv.num_usable_blocks
