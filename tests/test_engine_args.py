"""EngineArgs: every refusal before anything loads, and the configs made from it once."""

import argparse
import dataclasses

import pytest

from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.engine_flags import add_engine_args, engine_kwargs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, r"block_size must be an int >= 1, got 0"),
        ({"max_num_seqs": True}, r"max_num_seqs must be an int >= 1, got True"),
        ({"max_loras": 2, "max_cpu_loras": 1}, r"an int >= 2 \(max_loras\), got 1"),
        ({"num_gpu_blocks_override": 1}, r"reserved null block\), got 1"),
        ({"long_prefill_token_threshold": -1}, r"an int >= 0 \(0 = off\), got -1"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, r"in \[0, data_parallel_size=2\)"),
        ({"enable_chunked_prefill": "no"}, "enable_chunked_prefill must be a bool"),
        (
            {"enable_chunked_prefill": False, "long_prefill_token_threshold": 8},
            "must be 0 when chunked prefill is disabled",
        ),
        (
            {"enable_chunked_prefill": False, "max_model_len": 4096},
            r"max_num_batched_tokens must be >= max_model_len \(4096\)",
        ),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
        (
            {"all2all_backend": "deepep_low_latency"},
            (
                r"all2all_backend must be one of \('auto', 'allgather_reducescatter', "
                r"'ragged_all_to_all'\), got 'deepep_low_latency'"
            ),
        ),
        ({"runner": "pooling", "enable_lora": True}, "runner='pooling' is not"),
    ],
)
def test_a_bad_option_is_refused_when_the_args_are_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_a_field_set_after_construction_is_checked_by_create_engine_config():
    args = EngineArgs()
    args.max_num_seqs = 0
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        args.create_engine_config()


def test_vllms_none_defaults_turn_prefix_caching_and_chunked_prefill_on():
    config = EngineArgs(enable_prefix_caching=None, enable_chunked_prefill=None)
    engine_config = config.create_engine_config()
    assert engine_config.cache_config.enable_prefix_caching is True
    assert engine_config.scheduler_config.enable_chunked_prefill is True


def test_each_component_gets_its_group_and_the_runner_the_schedulers_limits():
    config = EngineArgs(
        max_num_seqs=6,
        max_num_batched_tokens=96,
        num_scheduler_steps=4,
        block_size=8,
        enable_lora=True,
        max_loras=3,
    ).create_engine_config()
    scheduler, runner = config.scheduler_config, config.runner_config
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
        assert getattr(runner, name) == getattr(scheduler, name)
    assert runner.block_size == config.cache_config.block_size == 8
    assert config.lora_config.max_loras == scheduler.max_loras == 3
    assert config.lora_config.max_cpu_loras == runner.max_cpu_loras == 3  # None: max_loras
    assert config.speculative_config is None and config.pooler_config is None
    assert config.max_model_len is None  # the worker resolves it with the model
    resolved = config.resolved(256, "reference")
    assert resolved.scheduler_config.max_model_len == resolved.runner_config.max_model_len == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_config.block_size = 16


def test_data_parallel_across_processes_takes_one_rank_a_process():
    from jvllm.engine.data_parallel import make_engine

    with pytest.raises(ValueError, match="data_parallel_size=3 over 2 processes"):
        make_engine(
            None,
            data_parallel_size=3,
            distributed_coordinator_address="127.0.0.1:1",
            distributed_num_processes=2,
            distributed_process_id=0,
        )


def test_the_cli_takes_all2all_backend_as_vllm_spells_it():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).all2all_backend == "auto"
    args = parser.parse_args(["--all2all-backend", "ragged_all_to_all"])
    config = EngineArgs(**engine_kwargs(args)).create_engine_config()
    assert config.parallel_config.all2all_backend == "ragged_all_to_all"
