"""MoE layers across data-parallel ranks on fake CPU devices (distributed/data_parallel_moe.py):
one SPMD step over the (data, model) mesh runs D ranks' batches, each with its own KV pages, the
experts spread over all D x T devices, and gives each rank what its batch gives alone on one
device: a prefill step, then a decode step reading the pages the first wrote (the two ranks use
the same page ids, each in its own pool), with a rank that has nothing to run."""

import asyncio
import collections
import functools
import os
import re
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from family_parity import ragged_prompts, save_random_model
from jax.sharding import NamedSharding
from test_expert_parallel import FAMILIES
from test_family_deepseek import _save as _save_deepseek
from test_family_deepseek import v3_like
from test_family_gpt_oss import _save_gpt_oss

from jvllm import LLM
from jvllm.attention.backends import get_attention
from jvllm.distributed.data_parallel_moe import (
    KV_CACHE_SPEC,
    choose_all2all_backend,
    data_parallel_model,
)
from jvllm.distributed.mesh import make_mesh
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.async_llm import AsyncLLM
from jvllm.model_loader.hf import read_hf_config
from jvllm.model_loader.loader import load_model
from jvllm.models.model import compute_logits, forward
from jvllm.sampling_params import SamplingParams
from jvllm.worker.buckets import Bucket
from jvllm.worker.kv_layout import allocate_kv_cache, kv_cache_shape, kv_cache_spec
from jvllm.worker.step_inputs import prepare_step_inputs

BLOCK_SIZE, NUM_PAGES, MAX_PAGES = 8, 13, 8  # pages a rank, its own ids from 1 (0: null)
PREFILL = Bucket(num_tokens=64, num_seqs=4, tile_q=16)
DECODE = Bucket(num_tokens=4, num_seqs=4, tile_q=1)
VOCAB = 511
# Each rank's prompts: rank 1 runs one, rank 0 three; at the decode step rank 1 has none.
PROMPTS = (ragged_prompts(VOCAB, lengths=(3, 17, 30)), ragged_prompts(VOCAB, (21,), seed=1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    @functools.cache
    def save(name: str) -> str:
        path = tmp_path_factory.mktemp(name)
        if name == "deepseek_v3":
            _save_deepseek(path, v3_like())
        elif name == "looping_mixtral":  # attention scaled down: greedy continuations loop
            model = save_random_model(path, FAMILIES["mixtral"]())
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.mul_(0.03)
            model.save_pretrained(path)
        else:
            save = _save_gpt_oss if name == "gpt_oss" else save_random_model
            save(path, FAMILIES[name]())
        return str(path)

    return save


def _requests(prompts: list[list[int]], is_decode: bool):
    """What prepare_step_inputs reads of a request: prefilling `prompts`, or decoding one more
    token (id 7) after each."""
    greedy = SamplingParams(temperature=0.0)
    return [
        types.SimpleNamespace(
            all_token_ids=[*p, 7],
            prompt_token_ids=p,
            num_prompt_tokens=len(p),
            num_computed_tokens=len(p) if is_decode else 0,
            num_output_tokens=int(is_decode),
            sampling_params=greedy,
            seed=0,
        )
        for p in prompts
    ]


def _step_inputs(prompts: list[list[int]], is_decode: bool):
    """The step of `prompts` in their bucket, sequence s on pages from 1 + 4 s (4 a sequence)."""
    bucket = DECODE if is_decode else PREFILL
    requests = _requests(prompts, is_decode)
    num_scheduled = [1 if is_decode else len(p) for p in prompts]
    block_ids = [list(range(1 + 4 * s, 1 + 4 * s + 4)) for s in range(len(prompts))]
    return prepare_step_inputs(
        requests, num_scheduled, block_ids, bucket, BLOCK_SIZE, MAX_PAGES, VOCAB
    )


def _alone(path: str, steps) -> list[tuple[np.ndarray, np.ndarray]]:
    """One device running one rank's `steps` in turn on its own KV -> (hidden, logits) each."""
    config, params, _ = load_model(path, "float32", skip_tokenizer_init=True)
    attn = get_attention("reference", config.sm_scale)
    shape = kv_cache_shape(config, NUM_PAGES, BLOCK_SIZE)
    kv = allocate_kv_cache(kv_cache_spec("float32", "reference"), shape, jax.devices()[0])
    run = jax.jit(functools.partial(forward, config=config, attn=attn))
    out = []
    for inputs in steps:
        hidden, kv = run(params, kv, inputs.token_ids, inputs.positions, inputs.attn)
        logits = compute_logits(params, hidden[inputs.attn.logits_indices], config=config)
        out.append((np.asarray(hidden), np.asarray(logits)))
    return out


def _across_ranks(path: str, d: int, t: int, steps, all2all_backend: str):
    """The D ranks' steps, stacked, as one SPMD step each over the D x T mesh, the ranks'
    tokens exchanged by `all2all_backend` -> the model's config, the params, and
    (hidden [D, ...], logits [D, ...]) each step."""
    mesh = make_mesh(d, t)
    config, params, _ = load_model(
        path, "float32", mesh=mesh, skip_tokenizer_init=True, enable_expert_parallel=True
    )
    config = choose_all2all_backend(config, mesh, all2all_backend, PREFILL.num_tokens)
    model = data_parallel_model(
        config, mesh, get_attention("reference", config.sm_scale), False, params
    )
    shape = kv_cache_shape(config, d * NUM_PAGES, BLOCK_SIZE, t)
    sharding = NamedSharding(mesh, KV_CACHE_SPEC)
    kv = allocate_kv_cache(kv_cache_spec("float32", "reference"), shape, sharding)
    run = jax.jit(model.forward)
    out = []
    for ranks in steps:
        stacked = jax.tree.map(lambda *a: np.stack(a), *ranks)
        hidden, kv = run(params, kv, stacked.token_ids, stacked.positions, stacked.attn)
        rows = jnp.take_along_axis(hidden, stacked.attn.logits_indices[..., None], axis=1)
        out.append((np.asarray(hidden), np.asarray(model.logits(params, rows))))
    return config, params, out


def _experts_a_device(params) -> set[int]:
    """The routed experts each device holds of each MoE layer stack (gate_up [L, E, D, 2F])."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    stacks = [a for path, a in flat if jax.tree_util.keystr(path).endswith("['gate_up']")]
    stacks = [a for a in stacks if a.ndim == 4]  # not a dense MLP's fused gate_up
    return {shard.data.shape[1] for a in stacks for shard in a.addressable_shards}


GATHER, RAGGED = "allgather_reducescatter", "ragged_all_to_all"


@pytest.mark.parametrize(
    ("name", "d", "t", "all2all_backend"),
    [
        ("mixtral", 2, 1, GATHER),
        ("mixtral", 2, 2, GATHER),
        ("qwen2_moe", 2, 2, GATHER),
        ("deepseek_v3", 2, 2, GATHER),
        ("gpt_oss", 2, 2, GATHER),
        ("mixtral", 2, 1, RAGGED),
        ("mixtral", 2, 2, RAGGED),
        ("mixtral", 4, 1, RAGGED),
        ("deepseek_v3", 2, 1, RAGGED),
        ("deepseek_v3", 2, 2, RAGGED),
        ("gpt_oss", 2, 2, RAGGED),
    ],
)
def test_each_rank_gets_what_its_batch_gives_alone_on_one_device(
    model_dir, name, d, t, all2all_backend
):
    """Mixtral's 8 experts, 4 or 2 a device; Qwen2-MoE's 4, 1 a device, and its gated shared
    expert cut over "model", run on the rank's own tokens; DeepSeek-V3's grouped sigmoid router,
    shared expert and MLA's latent cache; gpt-oss's expert biases, whole or by expert. The
    tokens gathered to every device, or sent to their experts' devices alone by ragged
    all-to-alls (on a CPU, in blocks: layers/ragged_all_to_all.py), at D = 4 a token's 2
    experts on at most 2 of the 4 rows."""
    path = model_dir(name)
    prompts = [PROMPTS[r % 2] for r in range(d)]
    steps = [
        [_step_inputs(prompts[r], False) for r in range(d)],
        # Rank 1 has nothing to decode: a batch of padding, which writes only the null page.
        [_step_inputs(prompts[r] if r == 0 else [], True) for r in range(d)],
    ]
    config, params, spread = _across_ranks(path, d, t, steps, all2all_backend)
    assert config.all2all_backend == all2all_backend
    experts_a_device = config.num_experts // (d * t)
    assert _experts_a_device(params) == {experts_a_device}
    for r in range(d):
        alone = _alone(path, [step[r] for step in steps])
        for (hidden, logits), (one_hidden, one_logits), step in zip(spread, alone, steps):
            num_real = int(step[r].attn.query_start_loc[-1])
            num_seqs = len(prompts[r]) if step is steps[0] or r == 0 else 0
            np.testing.assert_allclose(
                hidden[r, :num_real], one_hidden[:num_real], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(
                logits[r, :num_seqs], one_logits[:num_seqs], rtol=1e-5, atol=1e-5
            )


ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def group_llm(path: str, t: int = 1, **options) -> LLM:
    """The model at `path` over two ranks whose MoE layers run across them, T devices each."""
    return LLM(
        path,
        data_parallel_size=2,
        tensor_parallel_size=t,
        enable_expert_parallel=True,
        **ENGINE_KWARGS,
        **options,
    )


def run_with_arrivals(engine, prompts, arrivals: tuple[int, ...], num_steps: int = 60):
    """Two of `prompts` first, then one more at each step of `arrivals` (while the ranks
    decode, a rank gets a newcomer), stepping until all finish -> each one's greedy tokens."""
    tokens = {}
    for i in range(2):
        engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, GREEDY)
    for step in range(num_steps):
        if step in arrivals:
            i = len(tokens) + sum(engine.has_request(str(j)) for j in range(len(prompts)))
            if i < len(prompts):
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, GREEDY)
        tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests() and len(tokens) == len(prompts):
            break
    return [tokens[str(i)] for i in range(len(prompts))]


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    ("t", "compile_all_buckets", "all2all_backend"),
    [(1, True, "auto"), (2, False, GATHER), (2, False, RAGGED)],
)
def test_engine_ranks_step_as_one_and_decode_as_one_device(
    model_dir, t, compile_all_buckets, all2all_backend
):
    """data_parallel_size=2 with enable_expert_parallel: two ranks, each its own scheduler and
    pages, every step of both one jitted call with Mixtral's 8 experts spread over the 2 t
    devices; five ragged prompts (rank 0 gets three, rank 1 two, and runs out first, stepping
    padding) decode greedily as one device decodes them, the tokens gathered ("auto" on a CPU)
    or sent by all-to-all. With compile_all_buckets every bucket's step compiles at start-up,
    and the steps compile nothing more."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB)
    expected = _greedy(LLM(path, **ENGINE_KWARGS), prompts)
    llm = LLM(
        path,
        data_parallel_size=2,
        tensor_parallel_size=t,
        enable_expert_parallel=True,
        compile_all_buckets=compile_all_buckets,
        all2all_backend=all2all_backend,
        **ENGINE_KWARGS,
    )
    group = llm.llm_engine.group.group_runner()
    assert group.config.all2all_backend == (RAGGED if all2all_backend == RAGGED else GATHER)
    num_buckets = len(group.buckets.all_buckets())
    assert group.num_compilations == (num_buckets if compile_all_buckets else 0)
    assert _greedy(llm, prompts) == expected
    assert group.num_group_steps > 0
    assert group.num_compilations <= num_buckets  # one executable a bucket at most
    if compile_all_buckets:
        assert group.num_compilations == num_buckets
    assert _experts_a_device(group.params) == {8 // (2 * t)}
    # Both ranks ran tokens: each counted its own tokens' routes.
    assert all(counts.sum() > 0 for counts in group.expert_token_counts.values())


def test_async_engine_streams_from_ranks_stepping_as_one(model_dir):
    """The server's engine over the group: requests arrive while the ranks step, stream back
    one device's tokens, and /metrics' expert counts sum both ranks' (every real token's
    top-2 routes in each of the 2 layers)."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB, lengths=(4, 11, 19))
    expected = _greedy(LLM(path, **ENGINE_KWARGS), prompts)
    args = EngineArgs(path, data_parallel_size=2, enable_expert_parallel=True, **ENGINE_KWARGS)
    llm = AsyncLLM.from_engine_args(args)

    async def one(i, prompt):
        stream = llm.generate({"prompt_token_ids": prompt}, GREEDY, f"r{i}")
        return [o async for o in stream][-1].outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(main()) == expected
        num_fed = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
        assert llm.stats.expert_token_counts.sum() == num_fed * 2 * 2
    finally:
        llm.shutdown()


def _step_collectives(path: str, all2all_backend: str) -> collections.Counter:
    """The collectives of Mixtral's compiled step at D = T = 2 (the layer scan's body once)."""
    mesh = make_mesh(2, 2)
    config, params, _ = load_model(
        path, "float32", mesh=mesh, skip_tokenizer_init=True, enable_expert_parallel=True
    )
    config = choose_all2all_backend(config, mesh, all2all_backend, DECODE.num_tokens)
    model = data_parallel_model(
        config, mesh, get_attention("reference", config.sm_scale), False, params
    )
    shape = kv_cache_shape(config, 2 * NUM_PAGES, BLOCK_SIZE, 2)
    kv = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, KV_CACHE_SPEC))
    step = jax.tree.map(lambda *a: np.stack(a), *[_step_inputs(PROMPTS[0], True)] * 2)
    lowered = jax.jit(model.forward).lower(params, kv, step.token_ids, step.positions, step.attn)
    text = lowered.compile().as_text()
    kinds = "all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all"
    # An op's shape, or a tuple of them (XLA:CPU's all-to-all returns one a peer).
    shape = r"(?:\S+|\([^)]*\))"
    return collections.Counter(re.findall(rf"= {shape} ({kinds})(?:-start)?\(", text))


def test_the_step_gathers_and_reduce_scatters_over_the_ranks_and_nothing_else(model_dir):
    """Mixtral at D = T = 2, the layer scan's body once: the MoE layer's all-gather of the
    ranks' tokens, weights and expert ids and its one reduce-scatter over "data"; tensor
    parallelism's all-reduces over "model" (attention's o, the experts, the embedding); no
    all-to-all."""
    ops = _step_collectives(model_dir("mixtral"), GATHER)
    assert ops == {"all-gather": 3, "reduce-scatter": 1, "all-reduce": 3}


def test_the_ragged_step_sends_tokens_by_all_to_all_and_gathers_none(model_dir):
    """all2all_backend="ragged_all_to_all" on a CPU: the MoE layer's exchanges are dense
    all-to-alls, 7: the sizes and first slots; out, the tokens', weights' and ids' blocks and
    the offsets they land at (one for the three); back, the partial sums' blocks and their
    offsets. No all-gather or reduce-scatter, and no ragged-all-to-all, which XLA:CPU cannot
    compile; tensor parallelism's all-reduces as before."""
    ops = _step_collectives(model_dir("mixtral"), RAGGED)
    assert ops == {"all-to-all": 7, "all-reduce": 3}


def test_auto_picks_the_gather_on_cpus_and_a_named_backend_is_kept(model_dir):
    """At D = 4 Mixtral's k = 2 < D - 1, so the all-to-all would move fewer bytes, but on
    CPUs (emulated in blocks as large as the gather) and in one process "auto" gathers."""
    mesh, config = make_mesh(4, 1), read_hf_config(model_dir("mixtral"))
    assert choose_all2all_backend(config, mesh, "auto", 32).all2all_backend == GATHER
    assert choose_all2all_backend(config, mesh, RAGGED, 32).all2all_backend == RAGGED


def test_each_rank_samples_and_scores_its_own_requests_as_one_device(model_dir):
    """Per-request sampling in the group: seeded sampling (top-k, a temperature) beside greedy
    requests with logprobs and prompt logprobs, spread over both ranks, give one device's
    tokens and logprobs (each rank's step samples with its own metadata)."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB, lengths=(6, 13, 9, 20))
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=1),
    ]

    def run(llm):
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [
            (
                o.outputs[0].token_ids,
                o.outputs[0].logprobs
                and [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs],
                o.prompt_logprobs
                and [d and {k: v.logprob for k, v in d.items()} for d in o.prompt_logprobs],
            )
            for o in outputs
        ]

    one = run(LLM(path, **ENGINE_KWARGS))
    assert one[0][1] and one[3][1] and one[2][2]  # the logprobs asked for, to compare
    group = run(LLM(path, data_parallel_size=2, enable_expert_parallel=True, **ENGINE_KWARGS))
    for (tokens, logprobs, prompt_logprobs), (one_tokens, one_logprobs, one_prompt) in zip(
        group, one
    ):
        assert tokens == one_tokens
        for got, want in [(logprobs, one_logprobs), (prompt_logprobs, one_prompt)]:
            assert (got is None) == (want is None)
            for row, want_row in zip(got or [], want or []):
                assert (row is None) == (want_row is None)
                if row is not None:
                    assert row.keys() == want_row.keys()
                    np.testing.assert_allclose(
                        [row[k] for k in want_row], list(want_row.values()), atol=1e-4
                    )


@pytest.mark.parametrize("t", [1, 2])
def test_ranks_run_decode_windows_as_one_and_decode_as_one_device(model_dir, t):
    """num_scheduler_steps=4 in the group: every rank's window steps as long as any rank's row
    decodes (their MoE layers exchange tokens every step), a rank whose rows stopped stepping
    its null page; a step where one rank prefills runs every rank's as one step. Greedy and
    seeded requests with stops inside windows and logprobs give one device's tokens, and
    windows ran."""
    path = model_dir("mixtral")
    prompts = ragged_prompts(VOCAB, lengths=(6, 13, 9, 20, 4))
    params = [
        SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=14, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]

    def run(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outputs]

    expected = run(LLM(path, **ENGINE_KWARGS))
    llm = group_llm(path, t, num_scheduler_steps=4)
    group = llm.llm_engine.group.group_runner()
    for got, want in zip(run(llm), expected):
        assert got.token_ids == want.token_ids
        for row, want_row in zip(got.logprobs or [], want.logprobs or []):
            assert row.keys() == want_row.keys()
            np.testing.assert_allclose(
                [row[k].logprob for k in want_row], [v.logprob for v in want_row.values()],
                atol=1e-4,
            )  # fmt: skip
    assert expected[0].logprobs and expected[3].logprobs
    assert group.num_windows > 0 and group.num_windows < group.num_group_steps


@pytest.mark.parametrize("drafts", [False, True])
def test_a_rank_prefilling_while_another_windows_runs_both_as_a_step(
    model_dir, monkeypatch, drafts
):
    """Requests arriving on one rank while the other decodes in windows (of speculative
    rounds, with a draft model: the target as its own): that step runs every rank's as one
    step (a window's requests take one token each, or verify their first round's drafts, in
    a window's form), and every request gives one device's greedy tokens."""
    from jvllm.worker import rank_group

    cut, rank_result = [], rank_group.read_rank_results

    def recording(kind, out, scheduler_output, *args):
        cut.append(kind == "step" and scheduler_output.num_steps > 1)
        return rank_result(kind, out, scheduler_output, *args)

    monkeypatch.setattr(rank_group, "read_rank_results", recording)
    path = model_dir("mixtral")
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    prompts = ragged_prompts(VOCAB, lengths=(6, 13, 9, 20, 4, 11))
    one = LLM(path, **ENGINE_KWARGS)
    expected = [o.outputs[0].token_ids for o in one.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]  # fmt: skip
    llm = LLM(
        path,
        data_parallel_size=2,
        enable_expert_parallel=True,
        num_scheduler_steps=4,
        speculative_config=spec if drafts else None,
        **ENGINE_KWARGS,
    )
    assert run_with_arrivals(llm.llm_engine, prompts, (2, 3, 5, 6)) == expected
    assert any(cut)  # some step ran a rank's window as one step
    if drafts:
        stats = [engine.spec_decoding_stats for engine in llm.llm_engine.replicas]
        assert all(s.num_accepted_tokens > 0 for s in stats)


def test_a_rank_waiting_on_a_grammar_holds_no_other_ranks_step(tmp_path, monkeypatch):
    """Rank 1's only request waits for its grammar (a slow compile) while rank 0 decodes: rank
    1's engine steps without waiting for it (a wait there held every rank's step back 50 ms),
    the front waits only when no rank has a step, and both requests finish, rank 0's with one
    device's tokens."""
    import shutil
    import threading

    from test_families_tp import _TINY

    from jvllm import StructuredOutputsParams
    from jvllm.model_loader.default_model import default_model_dir
    from jvllm.structured_output.manager import StructuredOutputManager

    config = transformers.MixtralConfig(
        **{**_TINY, "vocab_size": 49152}, num_local_experts=8, num_experts_per_tok=2
    )
    save_random_model(tmp_path, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the grammar's token strings
        shutil.copy(os.path.join(default_model_dir(), name), tmp_path)
    compile_, waits = StructuredOutputManager._compile, []

    def slow_compile(self, grammar, key):
        time.sleep(1.0)
        return compile_(self, grammar, key)

    def wait(self, timeout):
        waits.append(threading.current_thread().name)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    monkeypatch.setattr(StructuredOutputManager, "wait", wait)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema)
    )
    prompt = ragged_prompts(VOCAB, lengths=(9,))[0]
    expected = (
        LLM(str(tmp_path), **ENGINE_KWARGS)
        .generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    llm = LLM(str(tmp_path), data_parallel_size=2, enable_expert_parallel=True, **ENGINE_KWARGS)
    engine, done = llm.llm_engine, {}
    engine.add_request("plain", {"prompt_token_ids": prompt}, plain)  # rank 0
    engine.add_request("json", {"prompt_token_ids": prompt}, constrained)  # rank 1
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["plain"].outputs[0].token_ids == expected
    assert done["json"].outputs[0].finish_reason is not None
    assert not [name for name in waits if name.startswith("jvllm-dp")]  # no rank waited
