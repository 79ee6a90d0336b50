"""Expert parallelism (vLLM's `enable_expert_parallel`) over the mesh's "model" axis of T devices.

A mixture of experts' routed expert stacks are placed whole: device i holds experts
[i E/T, (i + 1) E/T), each with its whole F (gate_up [E/T, D, 2F], down [E/T, F, D]), where
tensor parallelism cuts every expert's F into T slices. Everything else is placed as tensor
parallelism places it: attention, dense MLPs and shared experts cut Megatron's way; the router,
DeepSeek's correction bias and gpt-oss's down biases replicated.

The hidden states are replicated on the T devices, so each device routes every token with its
whole router, runs only the (token, expert) assignments of its own experts (layers/moe.py's
`group_by_expert`), and the layer's one all-reduce sums the devices' partial outputs, as it
sums their F slices' under tensor parallelism: the same collectives, no all-to-all
(docs/design.md, "Expert parallelism").
"""

from __future__ import annotations

import dataclasses

from jvllm.config import ModelConfig
from jvllm.layers.params import DP_AXIS, TP_AXIS
from jvllm.logger import init_logger

logger = init_logger(__name__)

# The logical axis -> mesh axis rules of an expert stack under expert parallelism (the other
# params keep tensor_parallel.py's AXIS_RULES): cut by expert, its F ("mlp") whole, over the
# (data, model) devices row by row. A replica's own mesh has one row, so its T devices share
# the experts; the D x T mesh of the MoE layers across data-parallel ranks
# (distributed/data_parallel_moe.py) spreads them over every device.
EXPERT_PARALLEL_RULES = {"experts": (DP_AXIS, TP_AXIS)}


def is_expert_stack(axes: tuple[str | None, ...]) -> bool:
    """Whether a param of these logical axes holds each routed expert's own weights (gate_up,
    down, gpt-oss's gate_up bias: it names "experts" and "mlp"), not a router or a bias read
    by global expert id after the all-reduce (which name "experts" alone)."""
    return "experts" in axes and "mlp" in axes


def expert_parallel_config(
    config: ModelConfig, num_shards: int, enable: bool, num_data_ranks: int = 1
) -> ModelConfig:
    """`config` with its routed experts placed whole over `num_shards` devices where `enable`
    (the loaders' one step from enable_expert_parallel to the placement); on a mesh of
    `num_data_ranks` rows (the MoE layers across data-parallel ranks,
    distributed/data_parallel_moe.py), over all num_data_ranks x num_shards devices. A no-op,
    logged, for a model without routed experts or on one device; ValueError where the experts
    do not divide over the devices."""
    if not enable:
        return config
    if not config.num_experts:
        logger.info(
            "enable_expert_parallel: %s has no routed experts; nothing to place",
            config.architecture,
        )
        return config
    if num_shards * num_data_ranks == 1:
        logger.info("enable_expert_parallel: one device holds every expert; nothing to place")
        return config
    check_expert_parallel(config, num_shards, num_data_ranks)
    return dataclasses.replace(config, is_expert_parallel=True)


def check_expert_parallel(config: ModelConfig, num_shards: int, num_data_ranks: int = 1) -> None:
    """ValueError, naming the numbers, unless the routed experts divide over the devices."""
    num_experts = config.num_experts
    if num_data_ranks > 1 and num_experts % (num_shards * num_data_ranks):
        raise ValueError(
            f"enable_expert_parallel=True with data_parallel_size={num_data_ranks} places each "
            f"of {config.architecture}'s {num_experts} routed experts whole on one of "
            f"data_parallel_size x tensor_parallel_size = {num_data_ranks * num_shards} "
            f"devices, which needs that product to divide {num_experts}; choose sizes whose "
            "product divides it"
        )
    if num_experts % num_shards:
        raise ValueError(
            f"enable_expert_parallel=True places each of {config.architecture}'s "
            f"{num_experts} routed experts whole on one of tensor_parallel_size={num_shards} "
            f"devices, which needs tensor_parallel_size to divide {num_experts} (jvllm refuses "
            "uneven counts, which vLLM would place unevenly); choose a tensor_parallel_size "
            "that divides it, or leave enable_expert_parallel off to cut each expert's "
            "intermediate size instead"
        )
