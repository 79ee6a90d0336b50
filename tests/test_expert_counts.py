"""Per-expert token counts: every step of a model with routed experts counts its real tokens'
(token, expert) assignments per MoE layer, the runner sums them, and /metrics shows them."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import _dense_causal_attn, scrape_metrics
from family_parity import save_random_model
from test_family_deepseek import _save as _save_deepseek
from test_family_deepseek import v3_like
from test_family_gpt_oss import _gpt_oss, _save_gpt_oss
from test_family_olmoe_granitemoe_falcon import ENGINE_CONFIGS

from jvllm import LLM, SamplingParams
from jvllm.distributed.mesh import make_mesh
from jvllm.distributed.sharded_model import sharded_model
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.metrics import ServingMetrics
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread
from jvllm.layers.scan import unstack_layers
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import forward_counting_experts, num_moe_layers, param_axes
from jvllm.step_loop import StepLoop

VOCAB = 256
TOP_K = 2
# Layer 0 a dense MLP (its own stack, uncounted), layers 1 and 2 four experts each.
QWEN3_MOE = transformers.Qwen3MoeConfig(
    num_hidden_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=48,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    num_experts=4,
    num_experts_per_tok=TOP_K,
    mlp_only_layers=[0],
)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43], [38, 32, 79, 50, 28]]
MAX_TOKENS = 4
# Requests that end at different steps: the rows left behind in a decode window or a step run
# ahead still compute, and must not count.
RAGGED_MAX_TOKENS = [2, 7, 4]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the tiny model's directory, its HF model)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    return str(path), save_random_model(path, QWEN3_MOE)


def _run(path: str, max_tokens: list[int], **engine_kwargs) -> tuple[LLM, list[list[int]]]:
    """(the engine after PROMPTS, each sequence's tokens fed to the model)."""
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=32, **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    # The last token sampled is never fed back.
    return llm, [p + list(o.outputs[0].token_ids[:-1]) for p, o in zip(PROMPTS, outputs)]


@pytest.fixture(scope="module")
def counted(saved):
    """(the engine after PROMPTS, each sequence's tokens fed to the model, the HF model)."""
    path, hf_model = saved
    return *_run(path, [MAX_TOKENS] * len(PROMPTS)), hf_model


def _hf_counts(hf_model, sequences) -> np.ndarray:
    """Each MoE layer's top-k picks of HF's router over `sequences`, counted -> [L_moe, E]."""
    counts = np.zeros((2, QWEN3_MOE.num_experts), np.int64)
    for tokens in sequences:
        with torch.no_grad():
            out = hf_model(torch.tensor([tokens]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # the sparse layers' alone
            picks = torch.topk(logits.float(), TOP_K, dim=-1).indices.numpy().reshape(-1)
            counts[layer] += np.bincount(picks, minlength=QWEN3_MOE.num_experts)
    return counts


def test_expert_counts_equal_hf_routing_of_the_tokens_the_steps_fed(counted):
    """Padding tokens of each bucket count nothing; every real one k times per MoE layer."""
    llm, fed, hf_model = counted
    counts = llm.llm_engine.model_runner.expert_token_counts
    np.testing.assert_array_equal(counts, _hf_counts(hf_model, fed))
    num_tokens = sum(len(s) for s in fed)
    assert counts.sum() == num_tokens * TOP_K * 2


@pytest.mark.slow
def test_rows_that_stopped_in_a_decode_window_count_nothing(saved):
    path, hf_model = saved
    # Every shape compiled up front: a window runs only once its executable is ready.
    llm, fed = _run(path, RAGGED_MAX_TOKENS, num_scheduler_steps=4, compile_all_buckets=True)
    counts = llm.llm_engine.model_runner.expert_token_counts
    np.testing.assert_array_equal(counts, _hf_counts(hf_model, fed))


@pytest.mark.slow
def test_a_step_run_ahead_counts_at_most_one_token_more_for_each_request_that_ended(saved):
    """Async scheduling runs a request's next token before it is known to end (vLLM's does
    too); the device routed that token, the engine drops it, and it counts."""
    path, hf_model = saved
    llm, fed = _run(path, RAGGED_MAX_TOKENS, async_scheduling=True, compile_all_buckets=True)
    runner = llm.llm_engine.model_runner
    assert runner.num_steps_ahead_used > 0
    extra = runner.expert_token_counts - _hf_counts(hf_model, fed)
    assert (extra >= 0).all()
    assert (extra.sum(axis=1) <= len(PROMPTS) * TOP_K).all()


@pytest.mark.slow
def test_a_step_loops_steps_count_as_the_engines_do(saved):
    """Prefill in the engine, then decode steps in a StepLoop (rows that stop keep stepping,
    writing the null page): after finish() the runner's counts are HF's routing of every token
    fed."""
    path, hf_model = saved
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=32)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in RAGGED_MAX_TOKENS
    ]
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, params)
    step = loop.jit(loop.step)
    tokens, active = [], []
    for _ in range(max(RAGGED_MAX_TOKENS)):
        state, out = step(state)
        tokens.append(out.token_ids)
        active.append(out.active)
    outputs = loop.finish(state, jnp.stack(tokens), jnp.stack(active))
    fed = [p + o[:-1] for p, o in zip(PROMPTS, outputs)]
    counts = llm.llm_engine.model_runner.expert_token_counts
    np.testing.assert_array_equal(counts, _hf_counts(hf_model, fed))


def test_forward_counts_real_tokens_alike_with_the_layers_stacked_or_split(saved):
    """The scan's rows and the unrolled layers' (a GPU's layout) are the same counts; the
    padding tokens, which write the null page (slot 0), count nothing."""
    path, hf_model = saved
    config, params = load_hf_dir(path, "float32")
    real = PROMPTS[0][:9]
    token_ids = jnp.asarray(real + [0] * 7, jnp.int32)  # 9 real tokens, then padding
    slots = [16 + i for i in range(len(real))] + [0] * 7  # from page 1 on, then the null page
    metadata = types.SimpleNamespace(slot_mapping=jnp.asarray(slots, jnp.int32))
    attn = functools.partial(_dense_causal_attn, sm_scale=config.sm_scale)

    @jax.jit
    def counts(params):
        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        args = (params, jnp.zeros(()), token_ids, positions, metadata)
        return forward_counting_experts(*args, config=config, attn=attn)[2]

    expected = _hf_counts(hf_model, [real])
    np.testing.assert_array_equal(counts(params), expected)
    np.testing.assert_array_equal(counts(unstack_layers(params, param_axes(config))), expected)


def test_metrics_show_a_counter_per_moe_layer_and_expert(counted):
    """/metrics as a server serves it: one series per MoE layer and expert, the decoder
    layer's index in `layer`, the values the runner summed."""
    llm, _, _ = counted
    engine = AsyncLLM(llm.llm_engine)
    metrics = ServingMetrics(engine, "qwen3-moe")
    server = ServerThread(build_app(engine, "qwen3-moe", None, metrics)).start()
    try:
        samples = scrape_metrics(server.url)
    finally:
        server.stop()
        engine.shutdown()
    series = {
        (labels["layer"], labels["expert"]): value
        for (name, pairs), value in samples.items()
        if name == "jvllm:moe_expert_tokens_total"
        for labels in [dict(pairs)]
        if labels["model_name"] == "qwen3-moe"
    }
    counts = llm.llm_engine.model_runner.expert_token_counts
    assert series == {  # layer 0, dense, has no series
        (str(layer), str(e)): counts[layer - 1, e] for layer in (1, 2) for e in range(4)
    }


# Each family's own routing (DeepSeek's grouped sigmoid after a dense layer, gpt-oss's biased
# router, Granite's ungated shared expert): every real token counted k times a MoE layer.
OTHER_FAMILIES = {
    "deepseek_v3": lambda path: _save_deepseek(path, v3_like(num_hidden_layers=3)),
    "gpt_oss": lambda path: _save_gpt_oss(path, _gpt_oss()),
    "granitemoeshared": lambda path: save_random_model(path, ENGINE_CONFIGS["granitemoeshared"]()),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHER_FAMILIES))
def test_every_moe_family_counts_each_real_token_k_times_a_moe_layer(tmp_path, name):
    OTHER_FAMILIES[name](tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(PROMPTS, greedy, use_tqdm=False)
    config = llm.llm_engine.model_config
    counts = llm.llm_engine.model_runner.expert_token_counts
    num_fed = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    num_moe = num_moe_layers(config)
    assert num_moe == config.num_layers - (name == "deepseek_v3")  # V3's first layer dense
    assert counts.shape == (num_moe, config.num_experts)
    assert counts.sum() == num_fed * config.num_experts_per_tok * num_moe
    assert (counts.sum(axis=1) == num_fed * config.num_experts_per_tok).all()


def test_a_model_without_experts_counts_nothing():
    """Its step runs the plain forward: no count traced, nothing returned."""
    llama = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96
    )
    config = model_config_from_hf(llama, "float32")
    assert num_moe_layers(config) == 0
    model = sharded_model(config, make_mesh(), None, layers_unstacked=False, params={})
    assert model.forward_counting_experts is None
    assert num_moe_layers(model_config_from_hf(QWEN3_MOE, "float32")) == 2
