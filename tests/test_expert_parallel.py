"""Expert parallelism without a mesh: which params are cut by expert, each device's model, and
the held experts' partial sums, which add up over the devices to the whole layer. The engines
over fake devices are in scale_out/test_expert_parallel.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from family_parity import TINY_SHAPES
from jax.sharding import PartitionSpec as P

from jvllm.distributed.expert_parallel import expert_parallel_config
from jvllm.distributed.tensor_parallel import param_specs, shard_config, sharded_param_shapes
from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.cli import build_parser
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.layers.gpt_oss_moe import gpt_oss_experts
from jvllm.layers.moe import group_by_expert, moe_mlp, route
from jvllm.model_loader.hf_config import model_config_from_hf
from jvllm.models.model import param_shapes
from jvllm.worker.rank_group_worker import runs_moe_across_ranks


def _config(hf_config, num_shards: int = 4):
    """The ModelConfig of `hf_config` with its experts placed whole over `num_shards` devices."""
    return expert_parallel_config(model_config_from_hf(hf_config, "float32"), num_shards, True)


def _qwen2_moe(num_experts: int = 8) -> transformers.Qwen2MoeConfig:
    """8 experts of F 48 beside a shared expert of 80."""
    return transformers.Qwen2MoeConfig(
        **TINY_SHAPES,
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
    )


def test_expert_stacks_are_cut_by_expert_and_the_rest_as_under_tensor_parallelism():
    config = _config(_qwen2_moe())
    mlp = param_specs(config)["layers"]["mlp"]
    # [L, E, ., .]: over a replica's [1, T] mesh, or every device of the D x T one
    assert mlp["gate_up"] == mlp["down"] == P(None, ("data", "model"), None, None)
    assert mlp["router"] == P(None, None, None)  # every device routes every token
    assert mlp["shared_expert"]["gate_up"]["weight"] == P(None, "model", None)  # its F cut
    assert mlp["shared_expert"]["down"]["weight"] == P(None, None, "model")
    tensor_parallel = param_specs(model_config_from_hf(_qwen2_moe(), "float32"))
    assert tensor_parallel["layers"]["mlp"]["gate_up"] == P(None, None, None, "model")


def test_gpt_oss_expert_biases_follow_their_experts_and_the_down_biases_stay_whole():
    """gate_up's bias is read by the held experts' ids; down's after the all-reduce, by the
    router's."""
    gpt_oss = transformers.GptOssConfig(
        **{**TINY_SHAPES, "intermediate_size": 32}, head_dim=16, num_local_experts=4
    )
    mlp = param_specs(_config(gpt_oss, 2))["layers"]["mlp"]
    assert mlp["gate_up_bias"] == P(None, ("data", "model"), None)
    assert mlp["down_bias"] == mlp["router"] == P(None, None, None)
    assert mlp["router_bias"] == P(None, None)


def test_each_device_runs_a_share_of_whole_experts():
    """Mixtral's experts read intermediate_size, which the device's config cuts for the dense
    MLPs: its experts keep the whole width as moe_intermediate_size."""
    mixtral = transformers.MixtralConfig(**TINY_SHAPES, num_local_experts=8)
    config = _config(mixtral)
    local = shard_config(config, 4)
    assert (local.num_local_experts, local.num_experts) == (2, 8)
    assert local.moe_intermediate_size == TINY_SHAPES["intermediate_size"]
    mlp = param_shapes(local)["layers"]["mlp"]
    assert mlp["gate_up"].shape == (2, 2, 64, 2 * 128) and mlp["router"].shape == (2, 8, 64)
    # The devices' slices side by side are the checkpoint's whole stacks.
    shapes = lambda params: jax.tree.map(lambda s: s.shape, params["layers"]["mlp"])
    assert shapes(sharded_param_shapes(config, 4)) == shapes(param_shapes(config))


def test_group_by_expert_sorts_the_other_devices_assignments_after_every_group():
    """Device 1 of 2 holds experts 2 and 3 of 4: the assignments to 0 and 1 are in no group."""
    experts = jnp.asarray([[3, 0], [1, 2], [2, 3]], jnp.int32)  # [T = 3, k = 2]
    local, order, group_sizes, is_held = group_by_expert(experts, 2, jnp.int32(2))
    assert local.tolist() == [1, 2, 2, 0, 0, 1]
    assert group_sizes.tolist() == [2, 2]
    assert order.tolist()[:4] == [3, 4, 0, 5]  # expert 2's assignments, then expert 3's
    assert is_held.tolist() == [[True, False], [False, True], [True, True]]


def _random_experts(num_experts: int, d: int = 16, f: int = 24, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (10, d))
    router = jax.random.normal(keys[1], (num_experts, d))
    gate_up = jax.random.normal(keys[2], (num_experts, d, 2 * f)) * 0.2
    down = jax.random.normal(keys[3], (num_experts, f, d)) * 0.2
    return x, router, gate_up, down


@pytest.mark.parametrize("num_shards", [2, 4])
def test_held_experts_partial_sums_add_up_to_the_whole_layer(num_shards):
    x, router, gate_up, down = _random_experts(8)
    weights, experts = route(x, router, 2, True)
    whole = moe_mlp(x, weights, experts, gate_up, down)
    n = 8 // num_shards
    parts = [
        moe_mlp(x, weights, experts, gate_up[i * n : (i + 1) * n], down[i * n : (i + 1) * n], i * n)
        for i in range(num_shards)
    ]
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_gpt_oss_held_experts_partial_sums_add_up_to_the_whole_layer():
    """With gate_up's biases: the rows of experts held elsewhere get one too, and are dropped."""
    x, router, gate_up, down = _random_experts(4, seed=1)
    bias = jax.random.normal(jax.random.key(2), (4, 48))
    weights, experts = route(x, router, 2, True)
    run = lambda first, e: gpt_oss_experts(
        x, weights, experts, gate_up[e], bias[e], down[e], 1.702, 1.0, first
    )
    whole = run(None, slice(0, 4))
    halves = run(jnp.int32(0), slice(0, 2)) + run(jnp.int32(2), slice(2, 4))
    np.testing.assert_allclose(np.asarray(halves), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_experts_that_do_not_divide_over_the_devices_are_refused():
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True places each of .* 6 routed"):
        _config(_qwen2_moe(num_experts=6))


def test_experts_across_data_parallel_ranks_divide_over_every_device():
    """D = 2 ranks of T = 1: 8 experts, 4 a device; 6 experts over D x T = 4 are refused."""
    config = expert_parallel_config(model_config_from_hf(_qwen2_moe(), "float32"), 1, True, 2)
    assert config.is_expert_parallel and config.num_local_experts == 8  # the whole model's
    assert dataclasses.replace(config, num_data_ranks=2).num_local_experts == 4  # a device's
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 .* 6 routed .* tensor_parallel_size = 4 devices"
    ):
        expert_parallel_config(model_config_from_hf(_qwen2_moe(6), "float32"), 2, True, 2)


def test_moe_layers_run_across_ranks_only_for_an_moe_checkpoint_with_the_option(tmp_path):
    """Data parallelism runs one group of ranks for a mixture of experts with
    enable_expert_parallel; a dense model, or no option, runs independent replicas."""
    _qwen2_moe().save_pretrained(tmp_path / "moe")
    transformers.LlamaConfig(**TINY_SHAPES).save_pretrained(tmp_path / "dense")
    config = lambda name, **kwargs: EngineArgs(
        str(tmp_path / name), data_parallel_size=2, **kwargs
    ).create_engine_config()
    assert runs_moe_across_ranks(config("moe", enable_expert_parallel=True))
    assert not runs_moe_across_ranks(config("moe"))
    assert not runs_moe_across_ranks(config("dense", enable_expert_parallel=True))


def test_without_experts_or_on_one_device_it_is_a_logged_no_op(capsys):
    llama = model_config_from_hf(transformers.LlamaConfig(**TINY_SHAPES), "float32")
    assert expert_parallel_config(llama, 4, True) is llama
    qwen = model_config_from_hf(_qwen2_moe(), "float32")
    assert expert_parallel_config(qwen, 1, True) is qwen
    logged = capsys.readouterr().err
    assert "LlamaForCausalLM has no routed experts" in logged
    assert "one device holds every expert" in logged


def test_engine_args_and_the_cli_carry_enable_expert_parallel():
    parallel = EngineArgs(enable_expert_parallel=True).create_engine_config().parallel_config
    assert parallel.enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        EngineArgs(enable_expert_parallel="yes")
    parse = lambda *flags: engine_kwargs(build_parser().parse_args(["serve", "m", *flags]))
    assert parse("--enable-expert-parallel")["enable_expert_parallel"] is True
    assert parse()["enable_expert_parallel"] is False
