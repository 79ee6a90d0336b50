"""The layer scan: decoder layers built stacked on a leading "layers" axis and run as one
`lax.scan`, so a compiled step holds one layer, not L of them (docs/design.md "Layer scan")."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.quantization import is_quantized
from jvllm.quantization.packed_weight import GGUFWeight


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
        weights = jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), weights
        )
        if _is_one_cpu_row(carry) and _has_gguf_blocks(weights):
            # One row on CPU: copy the slice as it is, so the dequantization stays fused into
            # the multiply-reduce that reads it (GGUFWeight.dense); XLA:CPU would otherwise
            # write the slice out converted to float32 in a slow fusion (bfloat16 weights read
            # that way ran batch-1 decode at 3 against 36 tok/s). Float and int8/fp8 weights
            # go to the matmul library, which reads a slice in place.
            weights = jax.lax.optimization_barrier(weights)
        return body(nnx.merge(graphdef, weights), carry, layer, extra), None

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(step, carry, (layer_ids, per_layer))
    return carry


def _is_one_cpu_row(carry: Any) -> bool:
    x = jax.tree.leaves(carry)[0]  # the residual stream [T, D] leads the carry
    return x.shape[0] == 1 and jax.default_backend() == "cpu"


def _has_gguf_blocks(weights: nnx.State) -> bool:
    return any(isinstance(w, GGUFWeight) for w in jax.tree.leaves(weights, is_leaf=is_quantized))
