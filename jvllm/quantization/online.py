"""Online quantization: a float model's layer weights to int8 or fp8 at load."""

from __future__ import annotations

import jax

from jvllm.quantization.channel_weight import quantize_channels
from jvllm.quantization.expert_weight import quantize_experts


def quantize_layer_weights(params: dict, method: str, dtype: str) -> dict:
    """params with every stacked matmul weight (`layers...weight` [L, O, I]) replaced by its
    ChannelWeight (Qwen2-MoE's shared expert, a dense MLP, among them) and every stacked
    routed-expert weight (`layers...gate_up` / `down` [L, E, I, O]) by its ExpertWeight;
    embeddings, the LM head, norms, biases (gpt-oss's experts' too) and routers stay as they
    are."""

    def convert(path, x):
        keys = [getattr(k, "key", None) for k in path]
        # A model of two layer stacks (DeepSeek, Qwen-MoE with dense layers) names the other
        # "dense_layers" / "moe_layers".
        is_stacked = keys[0] in ("layers", "dense_layers", "moe_layers")
        if is_stacked and keys[-1] == "weight" and x.ndim == 3:
            return quantize_channels(x, method, dtype)
        if is_stacked and keys[-1] in ("gate_up", "down") and x.ndim == 4:
            return quantize_experts(x, method, dtype)
        return x

    return jax.tree_util.tree_map_with_path(convert, params)
