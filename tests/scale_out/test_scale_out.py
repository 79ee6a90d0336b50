"""Tensor and data parallelism on the 8 fake CPU devices conftest.py asks XLA for when
test_scale_out_suite.py runs this directory: the same tokens as one device, each device
holding 1/T of the weights and of the KV cache, the step's collectives what the Megatron
layout implies, and D replicas sharing the requests."""

import asyncio
import functools
import glob
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from family_parity import TP_VOCAB as VOCAB
from family_parity import (
    ragged_prompts,
    save_random_model,
    save_tp_llama,
)
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jvllm import LLM, LLMEngine, SamplingParams
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.tensor_parallel import shard_layout
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.data_parallel import replicas
from jvllm.layers.scan import UNSTACKED_LAYERS_ENV, _split_array
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.step_loop import StepLoop

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def kv2_dir(tmp_path_factory):
    """8 query heads, 2 KV heads: T = 4 and 8 repeat each KV head; tied embeddings."""
    return save_tp_llama(tmp_path_factory.mktemp("tp_kv2"), 2, tie=True)


@pytest.fixture(scope="module")
def kv8_dir(tmp_path_factory):
    """8 query and 8 KV heads, an LM head of its own."""
    return save_tp_llama(tmp_path_factory.mktemp("tp_kv8"), 8, tie=False)


@pytest.fixture(scope="module")
def one_device():
    """The T = 1 engines the sharded ones are compared with, one per model and setting."""
    return functools.cache(lambda path, **kwargs: LLM(path, **ENGINE_KWARGS, **kwargs))


def _summary(llm: LLM, params: SamplingParams, prompts) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for replica in replicas(llm.llm_engine):
        manager = replica.scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_usable_blocks  # every block came back
    return [(c.token_ids, c.finish_reason) for o in outputs for c in o.outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Chunked prefill (a 45-token prompt over 32-token steps), then a second batch whose prompts
# share the first's prefixes (prefix-cache hits).
PROMPTS = ragged_prompts(VOCAB)
SHARED = [p + [7, 8, 9] for p in PROMPTS[2:]]


@pytest.mark.parametrize(("model", "t"), [("kv2", 2), ("kv2", 4), ("kv2", 8), ("kv8", 8)])
def test_greedy_matches_one_device(request, one_device, model, t):
    path = request.getfixturevalue(f"{model}_dir")
    expected = one_device(path)
    sharded = LLM(path, tensor_parallel_size=t, **ENGINE_KWARGS)
    for prompts in (PROMPTS, SHARED):
        assert _summary(sharded, GREEDY, prompts) == _summary(expected, GREEDY, prompts)
    assert sharded.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits > 0


def test_preempted_requests_match_one_device(kv2_dir, one_device):
    """A pool of 12 blocks for five requests: some are preempted and recomputed."""
    kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 12}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _summary(one_device(kv2_dir, num_gpu_blocks_override=12), params, PROMPTS)
    sharded = LLM(kv2_dir, tensor_parallel_size=4, **kwargs)
    assert _summary(sharded, params, PROMPTS) == expected
    assert sharded.llm_engine.scheduler.num_preemptions_total > 0


def test_seeded_sampling_matches_one_device(kv8_dir, one_device):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, n=2)
    expected = _summary(one_device(kv8_dir), params, PROMPTS[:3])
    assert _summary(LLM(kv8_dir, tensor_parallel_size=4, **ENGINE_KWARGS), params, PROMPTS[:3]) == (
        expected
    )


def test_step_loop_runs_the_sharded_step(kv2_dir, one_device):
    """jvllm.step_loop chains the engine's step, shard_map and all, in a caller's jit."""
    llm = LLM(kv2_dir, tensor_parallel_size=4, **ENGINE_KWARGS)
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, GREEDY)
    call = loop.jit(lambda state: loop.step(state))
    tokens, active = [], []
    for _ in range(GREEDY.max_tokens - 1):
        state, out = call(state)
        tokens.append(out.token_ids)
        active.append(out.active)
    token_ids = loop.finish(state, jnp.stack(tokens), jnp.stack(active))
    expected = _summary(one_device(kv2_dir), GREEDY, PROMPTS)
    assert token_ids == [ids for ids, _ in expected]


def test_pallas_backend_matches_one_device(kv2_dir, one_device):
    kwargs = {**ENGINE_KWARGS, "attention_backend": "pallas"}
    expected = _summary(one_device(kv2_dir), GREEDY, PROMPTS[:3])
    assert _summary(LLM(kv2_dir, tensor_parallel_size=2, **kwargs), GREEDY, PROMPTS[:3]) == (
        expected
    )


def _local_shapes(array: jax.Array) -> set:
    return {shard.data.shape for shard in array.addressable_shards}


def test_each_device_holds_its_slice(kv2_dir):
    runner = LLM(kv2_dir, tensor_parallel_size=4, **ENGINE_KWARGS).llm_engine.model_runner
    layers = runner.params["layers"]
    # [L, (N + 2K) H, D] with 2 query heads and the 1 (repeated) KV head of each device.
    assert _local_shapes(layers["attn"]["qkv"]["weight"]) == {(2, (2 + 2) * 16, 64)}
    assert _local_shapes(layers["attn"]["o"]["weight"]) == {(2, 64, 2 * 16)}
    assert _local_shapes(layers["mlp"]["gate_up"]["weight"]) == {(2, 2 * 24, 64)}
    assert _local_shapes(layers["mlp"]["down"]["weight"]) == {(2, 64, 24)}
    assert _local_shapes(runner.params["embed"]["embedding"]) == {(251, 64)}  # 1004 / 4 rows
    assert _local_shapes(layers["input_norm"]["weight"]) == {(2, 64)}  # replicated
    num_blocks = runner.kv_cache.shape[3]
    assert _local_shapes(runner.kv_cache) == {(2, 2, 1, num_blocks, 16, 16)}
    assert len(runner.kv_cache.addressable_shards) == 4


def test_unstacked_layers_match_one_device(kv2_dir, one_device, monkeypatch):
    """The GPU's per-layer weights (layers/scan.py) on a mesh: each layer's slice on its
    device, shard_map's specs split the same way."""
    expected = _summary(one_device(kv2_dir), GREEDY, PROMPTS)
    monkeypatch.setenv(UNSTACKED_LAYERS_ENV, "1")
    sharded = LLM(kv2_dir, tensor_parallel_size=4, **ENGINE_KWARGS)
    qkv = sharded.llm_engine.model_runner.params["layers"]["attn"]["qkv"]["weight"]
    assert [_local_shapes(w) for w in qkv.layers] == [{((2 + 2) * 16, 64)}] * 2
    assert _summary(sharded, GREEDY, PROMPTS) == expected


@pytest.mark.parametrize("split", ["0", "1"], ids=["layer_scan", "unstacked_layers"])
def test_step_has_the_layouts_collectives(kv2_dir, monkeypatch, split):
    """Per layer, one all-reduce after o and one after down (the layer scan's body holds them
    once, the 2 unstacked layers each), one for the embedding lookup; one all-gather of the
    logits, and one more in the prompt-logprobs branch; nothing else (a param whose spec did not
    match its layout would be resharded by more)."""
    monkeypatch.setenv(UNSTACKED_LAYERS_ENV, split)
    runner = LLM(kv2_dir, tensor_parallel_size=4, **ENGINE_KWARGS).llm_engine.model_runner
    layer_bodies = 2 if split == "1" else 1
    for shape in runner.compiler.all_shapes()[:2]:
        text = runner.compiler.executables.wait(shape).as_text()
        ops = re.findall(r"= \S+ ([a-z-]+?)(?:-start)?\(", text)
        collectives = sorted(op for op in ops if op.startswith(("all-", "collective", "reduce-s")))
        assert collectives == ["all-gather"] * 2 + ["all-reduce"] * (2 * layer_bodies + 1)


def test_a_split_through_host_keeps_each_devices_slice():
    """How a GPU splits a stacked param (layers/scan.py), on 4 devices: each layer's slice
    lies where the stack's did."""
    mesh = Mesh(np.array(jax.devices()[:4]), (TP_AXIS,))
    host = np.arange(2 * 8 * 6, dtype=np.float32).reshape(2, 8, 6)
    x = jax.device_put(host, NamedSharding(mesh, PartitionSpec(None, TP_AXIS)))
    layers = _split_array(x, through_host=True)
    assert x.is_deleted()
    for layer, want in zip(layers, host, strict=True):
        assert layer.sharding == NamedSharding(mesh, PartitionSpec(TP_AXIS))
        assert _local_shapes(layer) == {(2, 6)}
        np.testing.assert_array_equal(np.asarray(layer), want)


def test_shard_layout_puts_each_devices_heads_together():
    """q|k|v of 4 query heads and 2 KV heads (H = 1) over 4 devices: device i holds query head
    i, then KV head i // 2 of k and of v."""
    q, k, v = np.arange(4), 10 + np.arange(2), 20 + np.arange(2)
    fused = np.concatenate([q, k, v])[:, None]  # [(N + 2K) H, D = 1]
    laid_out = shard_layout(fused, ("heads", "embed"), ((4, 1), (2, 1), (2, 1)), 4, (12, 1))
    assert laid_out[:, 0].tolist() == [0, 10, 20, 1, 10, 20, 2, 11, 21, 3, 11, 21]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 does not divide the 8 query heads"),
        ({"tensor_parallel_size": 16}, r"needs 16 devices, but 8 cpu device\(s\) are present"),
        (
            {"tensor_parallel_size": 4, "data_parallel_size": 4},
            r"data_parallel_size \(4\) x tensor_parallel_size \(4\) needs 16 devices",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1"),
        (
            {"data_parallel_size": 2, "data_parallel_rank": 1},
            "the data-parallel front end runs them all, so leave it unset",
        ),
    ],
)
def test_bad_sizes_are_refused(kv8_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(kv8_dir, **ENGINE_KWARGS, **kwargs)


def test_three_kv_heads_do_not_split_over_two(tmp_path):
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=64,
        vocab_size=VOCAB,
    )
    save_random_model(str(tmp_path), config)
    with pytest.raises(ValueError, match="does not divide the 3 KV heads"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE_KWARGS)


def test_data_parallel_replicas_share_requests_and_match_one_device(kv2_dir, one_device):
    """D = 2 x T = 2: requests alternate between the idle replicas, each prefix-cache hit is
    found within the replica that holds the prefix, and the tokens are one device's."""
    llm = LLM(kv2_dir, tensor_parallel_size=2, data_parallel_size=2, **ENGINE_KWARGS)
    for prompts in (PROMPTS, SHARED):
        assert _summary(llm, GREEDY, prompts) == _summary(one_device(kv2_dir), GREEDY, prompts)
    engines = llm.llm_engine.replicas
    assert [r.worker.mesh.devices.flatten().tolist() for r in engines] == [
        jax.devices()[0:2],
        jax.devices()[2:4],
    ]
    assert all(r.scheduler.num_prompt_tokens_total > 0 for r in engines)
    # Idle replicas take requests in turn, so each shared prompt went to the replica that
    # served its prefix, and hit that prefix's whole blocks (16 + 16 + 32 tokens).
    assert sum(r.scheduler.kv_cache_manager.prefix_cache_hits for r in engines) == 64


def test_an_llm_engine_runs_one_replica(kv8_dir):
    with pytest.raises(ValueError, match="an LLMEngine runs one replica, so it needs"):
        LLMEngine(kv8_dir, data_parallel_size=2, **ENGINE_KWARGS)


def test_async_engine_streams_from_data_parallel_replicas(kv2_dir, one_device):
    expected = _summary(one_device(kv2_dir), GREEDY, PROMPTS)
    args = EngineArgs(kv2_dir, data_parallel_size=2, **ENGINE_KWARGS)
    llm = AsyncLLM.from_engine_args(args)

    async def one(i, prompt):
        outputs = [o async for o in llm.generate({"prompt_token_ids": prompt}, GREEDY, f"r{i}")]
        return outputs[-1].outputs[0]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        finals = asyncio.run(main())
        assert [(c.token_ids, c.finish_reason) for c in finals] == expected
        assert llm.stats.num_running == 0
        assert llm.stats.num_prompt_tokens == sum(len(p) for p in PROMPTS)
    finally:
        llm.shutdown()


def test_a_replicas_failure_fails_only_the_generate_it_happened_in(kv2_dir, monkeypatch):
    llm = LLM(kv2_dir, data_parallel_size=2, **ENGINE_KWARGS)
    second = llm.llm_engine.replicas[1]

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(second.model_runner, "execute_model", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # one prompt a replica
    monkeypatch.undo()
    # The next call's one prompt runs on the first replica alone; the second's failed
    # request of the last step is not this call's.
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"


def test_load_weights_lays_params_out_as_the_loader_does(kv2_dir, one_device):
    """load_weights at T = 4 (fused q|k|v shard-major, KV heads repeated, the vocabulary
    padded): the checkpoint's own weights loaded again leave the tokens one device gives."""
    (path,) = glob.glob(f"{kv2_dir}/*.safetensors")
    sharded = LLM(kv2_dir, tensor_parallel_size=4, **ENGINE_KWARGS)
    sharded.load_weights(read_safetensors(path).items())
    prompts = PROMPTS[:2]
    assert _summary(sharded, GREEDY, prompts) == _summary(one_device(kv2_dir), GREEDY, prompts)
