"""The rotary families' decoder layers in turn under the layer scan, each with its own sliding
window and rotary (cos, sin): the global set, a local one, or none."""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import AttentionFn, layer_windows
from jvllm.layers.hidden_capture import capture_layer_input
from jvllm.layers.rotary import rope_cos_sin
from jvllm.layers.scan import num_stacked_layers, scan_layers


def run_rotary_layers(
    layers: nnx.Module,
    x: jax.Array,
    kv_cache,
    positions: jax.Array,
    config: ModelConfig,
    metadata,
    attn: AttentionFn,
    *,
    local_layers: Sequence[bool] | None = None,
    rope_layers: Sequence[bool] | None = None,
    first_layer: int = 0,
    cos_sin: tuple[jax.Array, jax.Array] | None = None,
    after_layer: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
):
    """x f32[T, D] through every layer of `layers` (stacked_layers) -> (x, kv_cache).

    Layer i runs `layer(x, i, cos, sin, window, kv_cache, metadata, attn)` with its window
    (`layer_windows`) and its (cos, sin) f32[T, R]: the global set; the local one where
    `local_layers[i]` (Gemma 3's and OLMo 3's windowed layers: their own base, no scaling); or
    a rotation by angle 0 (cos 1, sin 0, which leaves q and k exact) where not
    `rope_layers[i]` (SmolLM3, Cohere2's global layers). Both sets are computed once per step,
    and each layer picks its own by its flag, so the scan still runs one layer.

    A model whose layers are of two kinds (DeepSeek's dense, then MoE layers) runs one stack of
    each in turn: `layers` then holds the model's layers from `first_layer` on, which keep their
    KV-cache layer indices and their per-layer settings (given above for all L layers).

    `cos_sin`: the global set as the caller computed it (M-RoPE's, rotary.py's mrope_cos_sin),
    in place of rope_cos_sin(positions).

    `after_layer(x, layer)`: x f32[T, D] after layer `layer` (i32[], traced) -> the next
    layer's input (Qwen3-VL's DeepStack adds image features after its first layers).
    """
    cos, sin = rope_cos_sin(positions, config) if cos_sin is None else cos_sin  # [T, R] each
    per_layer = {"window": layer_windows(config)}  # i32[L] or None
    if local_layers is not None:
        local_cos, local_sin = rope_cos_sin(positions, config, local=True)
        per_layer["is_local"] = jnp.asarray(local_layers)  # bool[L]
    if rope_layers is not None:
        per_layer["use_rope"] = jnp.asarray(rope_layers)  # bool[L]
    num_layers = num_stacked_layers(layers)
    if (first_layer, num_layers) != (0, config.num_layers):
        span = slice(first_layer, first_layer + num_layers)
        per_layer = jax.tree.map(lambda a: a[span], per_layer)  # [this stack's layers]

    def body(layer_module, carry, layer, extra):
        x, kv_cache = carry
        layer_cos, layer_sin = cos, sin
        if "is_local" in extra:
            layer_cos = jnp.where(extra["is_local"], local_cos, layer_cos)
            layer_sin = jnp.where(extra["is_local"], local_sin, layer_sin)
        if "use_rope" in extra:
            layer_cos = jnp.where(extra["use_rope"], layer_cos, 1.0)
            layer_sin = jnp.where(extra["use_rope"], layer_sin, 0.0)
        window = extra["window"]
        layer = layer + first_layer if first_layer else layer
        capture_layer_input(layer, x)  # a draft head's (EAGLE-3) read of the layer's input
        x, kv_cache = layer_module(x, layer, layer_cos, layer_sin, window, kv_cache, metadata, attn)
        return (x, kv_cache) if after_layer is None else (after_layer(x, layer), kv_cache)

    return scan_layers(layers, body, (x, kv_cache), per_layer=per_layer)
