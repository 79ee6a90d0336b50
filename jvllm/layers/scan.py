"""The layer scan: decoder layers built stacked on a leading "layers" axis and run as one
`lax.scan`, so a compiled step holds one layer, not L of them (docs/design.md "Layer scan").

On a GPU the stacked weights are split into one array per layer once, at start-up
(`unstack_layers`), and the layers run unrolled over them: inside a scan XLA:GPU copies each
layer's slice out of the stack before its matmuls, so a decode step moves its weights three
times (docs/design.md "Layer scan"; BENCHMARKS.md, "The layer scan on a GPU")."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jvllm.quantization import QuantizedWeight, is_quantized

# "1": per-layer arrays on every backend, "0": the stacked scan on every backend; unset: on a GPU.
UNSTACKED_LAYERS_ENV = "JVLLM_UNSTACKED_LAYERS"


def stacked_layers(make_layer: Callable[[], nnx.Module], num_layers: int) -> nnx.Module:
    """One module whose every weight has a leading [L] axis, named "layers"."""
    stack = nnx.vmap(
        make_layer,
        axis_size=num_layers,
        out_axes=0,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return stack()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Unstacked:
    """A stacked [L, ...] param as L per-layer params (arrays or quantized weights), each its
    own buffer: what a params leaf becomes under unstack_layers."""

    layers: tuple


def is_unstacked(x) -> bool:
    return isinstance(x, Unstacked)


def use_unstacked_layers() -> bool:
    """Whether the engine splits the layers' weights (see the module docstring)."""
    setting = os.environ.get(UNSTACKED_LAYERS_ENV)
    if setting not in (None, "0", "1"):
        raise ValueError(f"{UNSTACKED_LAYERS_ENV}={setting!r}; allowed: '0', '1' or unset")
    return jax.default_backend() == "gpu" if setting is None else setting == "1"


def unstack_layers(params: dict, axes: dict) -> dict:
    """Each param whose first axis is "layers" (in `axes`, models/model.py's param_axes) as an
    `Unstacked` of its L layers. Consumes `params`: each stacked array is deleted once split, so
    the device holds one param twice at most. Largest first, so that each param's layers can
    take the space the one before it freed: what stays free between the layers is about the
    largest param's size, not the sum of them all."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_quantized)
    names = treedef.flatten_up_to(axes)
    stacked = [i for i, n in enumerate(names) if n[:1] == ("layers",)]
    for i in sorted(stacked, key=lambda i: -leaves[i].nbytes):
        arrays, param_def = jax.tree.flatten(leaves[i])
        per_array = [_split_array(a) for a in arrays]  # [array][layer]
        for a in arrays:
            a.delete()
        leaves[i] = Unstacked(tuple(param_def.unflatten(list(layer)) for layer in zip(*per_array)))
    return treedef.unflatten(leaves)


def unstack_specs(specs: dict, axes: dict, num_layers: int) -> dict:
    """shard_map's in_specs for unstack_layers' params, from the stacked params' `specs`
    (distributed/tensor_parallel.py's param_specs): a "layers" param's spec without its first
    axis, once per layer."""

    def split(names: tuple, spec: PartitionSpec):
        if names[:1] != ("layers",):
            return spec
        return Unstacked((PartitionSpec(*spec[1:]),) * num_layers)

    return jax.tree.map(split, axes, specs, is_leaf=lambda x: isinstance(x, tuple))


def _split_array(x: jax.Array) -> list[jax.Array]:
    """x [L, ...] -> L arrays [...], on x's devices and sharded as x's trailing axes."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    split = jax.jit(lambda x: [x[i] for i in range(x.shape[0])], out_shardings=sharding)
    return split(x)


def scan_layers(
    layers: nnx.Module,
    body: Callable[[nnx.Module, Any, jax.Array, Any], Any],
    carry: Any,
    per_layer: Any = None,
) -> Any:
    """carry = body(layer module, carry, layer index i32[], per_layer[i]) for each layer in turn.

    `layers` comes from stacked_layers, holding [L, ...] weights or unstack_layers' per-layer
    ones; `per_layer` is a pytree of [L, ...] arrays (e.g. each layer's sliding window) sliced
    along with the weights. Returns the last carry.
    """
    graphdef, state = nnx.split(layers)
    first = jax.tree.leaves(state, is_leaf=is_unstacked)[0]
    if is_unstacked(first):
        for i in range(len(first.layers)):
            weights = jax.tree.map(lambda w, i=i: w.layers[i], state, is_leaf=is_unstacked)
            extra = jax.tree.map(lambda a, i=i: a[i], per_layer)
            carry = body(nnx.merge(graphdef, weights), carry, jnp.int32(i), extra)
        return carry

    def step(carry, xs):
        layer, extra = xs
        # The barrier ties the stacked weights to the layer index, so that XLA cannot hoist
        # work on them out of the loop: it converted every bfloat16 layer to float32 before the
        # loop, each step (a SmolLM2 decode step 15x slower on CPU).
        weights, layer = jax.lax.optimization_barrier((state, layer))
        weights = jax.tree.map(lambda w: _at_layer(w, layer), weights, is_leaf=is_quantized)
        return body(nnx.merge(graphdef, weights), carry, layer, extra), None

    layer_ids = jnp.arange(first.shape[0], dtype=jnp.int32)
    carry, _ = jax.lax.scan(step, carry, (layer_ids, per_layer))
    return carry


def _at_layer(w: jax.Array | QuantizedWeight, layer: jax.Array) -> jax.Array | QuantizedWeight:
    """Layer i32[] of a stacked weight: a quantized one keeps its stacked fields and the index,
    so that a CPU kernel (quantization/cpu_gguf.py, cpu_int8.py) reads the layer in place."""
    if is_quantized(w):
        return w.at_layer(layer)
    return jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
