"""Online quantization: a float model's layer weights to int8 or fp8 at load."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jvllm.quantization.channel_weight import ChannelWeight, quantize_channels
from jvllm.quantization.expert_weight import ExpertWeight, quantize_experts


def quantize_layer_weights(params: dict, method: str, dtype: str) -> dict:
    """params with every stacked matmul weight (`layers...weight` [L, O, I]) replaced by its
    ChannelWeight (Qwen2-MoE's shared expert, a dense MLP, among them) and every stacked
    routed-expert weight (`layers...gate_up` / `down` [L, E, I, O]) by its ExpertWeight;
    embeddings, the LM head, norms, biases (gpt-oss's experts' too) and routers stay as they
    are. A weight already cut over a mesh stays cut alike (see `_cut_like`)."""

    def convert(path, x):
        keys = [getattr(k, "key", None) for k in path]
        # A model of two layer stacks (DeepSeek, Qwen-MoE with dense layers) names the other
        # "dense_layers" / "moe_layers".
        is_stacked = keys[0] in ("layers", "dense_layers", "moe_layers")
        if is_stacked and keys[-1] == "weight" and x.ndim == 3:
            return _cut_like(quantize_channels(x, method, dtype), x, in_axis=-1)
        if is_stacked and keys[-1] in ("gate_up", "down") and x.ndim == 4:
            return _cut_like(quantize_experts(x, method, dtype), x, in_axis=-2)
        return x

    return jax.tree_util.tree_map_with_path(convert, params)


def _cut_like(
    weight: ChannelWeight | ExpertWeight, w: jax.Array, in_axis: int
) -> ChannelWeight | ExpertWeight:
    """`weight`, quantized from the float `w` on a mesh, with its values cut as `w` is and its
    per-output-channel scale as w's output axis (whole on every device where w's input axis is
    cut: it factors out of each device's partial sums). Each field then has a NamedSharding of
    its own, which shard_map's in_specs read (distributed/tensor_parallel.py's
    params_in_specs); the rows quantized on the mesh are the laid-out rows, so the values
    already are each device's."""
    if not isinstance(w.sharding, NamedSharding):
        return weight
    spec = (*w.sharding.spec, *(None,) * (w.ndim - len(w.sharding.spec)))
    scale_spec = PartitionSpec(*(a for i, a in enumerate(spec) if i != w.ndim + in_axis))
    return dataclasses.replace(
        weight,
        values=jax.device_put(weight.values, w.sharding),
        scale=jax.device_put(weight.scale, NamedSharding(w.sharding.mesh, scale_spec)),
    )
