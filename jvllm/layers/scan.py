"""The layer scan: decoder layers built stacked on a leading "layers" axis and run as one
`lax.scan`, so a compiled step holds one layer, not L of them (docs/design.md "Layer scan")."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.quantization import QuantizedWeight, is_quantized


def stacked_layers(make_layer: Callable[[], nnx.Module], num_layers: int) -> nnx.Module:
    """One module whose every weight has a leading [L] axis, named "layers"."""
    stack = nnx.vmap(
        make_layer,
        axis_size=num_layers,
        out_axes=0,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return stack()


def scan_layers(
    layers: nnx.Module,
    body: Callable[[nnx.Module, Any, jax.Array, Any], Any],
    carry: Any,
    per_layer: Any = None,
) -> Any:
    """carry = body(layer module, carry, layer index i32[], per_layer[i]) for each layer in turn.

    `layers` comes from stacked_layers; `per_layer` is a pytree of [L, ...] arrays (e.g. each
    layer's sliding window) sliced along with the weights. Returns the last carry.
    """
    graphdef, state = nnx.split(layers)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def step(carry, xs):
        layer, extra = xs
        # The barrier ties the stacked weights to the layer index, so that XLA cannot hoist
        # work on them out of the loop: it converted every bfloat16 layer to float32 before the
        # loop, each step (a SmolLM2 decode step 15x slower on CPU).
        weights, layer = jax.lax.optimization_barrier((state, layer))
        weights = jax.tree.map(lambda w: _at_layer(w, layer), weights, is_leaf=is_quantized)
        return body(nnx.merge(graphdef, weights), carry, layer, extra), None

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(step, carry, (layer_ids, per_layer))
    return carry


def _at_layer(w: jax.Array | QuantizedWeight, layer: jax.Array) -> jax.Array | QuantizedWeight:
    """Layer i32[] of a stacked weight: a quantized one keeps its stacked fields and the index,
    so that a CPU kernel (quantization/cpu_gguf.py, cpu_int8.py) reads the layer in place."""
    if is_quantized(w):
        return w.at_layer(layer)
    return jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
