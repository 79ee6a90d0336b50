"""The layer scan: decoder layers built stacked on a leading "layers" axis and run as one
`lax.scan`, so a compiled step holds one layer, not L of them (docs/design.md "Layer scan").

On a GPU the stacked weights are split into one array per layer once, at start-up
(`unstack_layers`), and the layers run unrolled over them: inside a scan XLA:GPU copies each
layer's slice out of the stack before its matmuls, so a decode step moves its weights three
times (docs/design.md "Layer scan"; BENCHMARKS.md, "The layer scan on a GPU")."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jvllm.layers.expert_counts import add_stack, counted_layer
from jvllm.layers.hidden_capture import active_capture
from jvllm.logger import init_logger
from jvllm.quantization import MixedGGUFWeight, QuantizedWeight, cpu_dense, is_quantized
from jvllm.quantization.dot import dot_layer

logger = init_logger(__name__)

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` (i32[]) of a stacked weight `stack` [L, O, I], not sliced yet: what a
    scanned layer's module holds in place of a float param where the CPU kernel runs. Read
    whole (`param[...]`, e.g. an MoE router's) it is sliced, which inside the scan XLA:CPU does
    by copying the layer out; a dense layer's matmul (`dense`) hands the stack and the index to
    the kernel instead (quantization/dot.py)."""

    stack: jax.Array
    layer: jax.Array

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError("a layer's weight is read whole (weight[...]) or through dense()")
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False)

    def dense(self, x: jax.Array) -> jax.Array:
        """x [..., I] @ the layer [O, I].T -> f32[..., O]."""
        return dot_layer(x, self.stack, self.layer)


def use_unstacked_layers() -> bool:
    """Whether the engine splits the layers' weights (see the module docstring)."""
    setting = os.environ.get(UNSTACKED_LAYERS_ENV)
    if setting not in (None, "0", "1"):
        raise ValueError(f"{UNSTACKED_LAYERS_ENV}={setting!r}; allowed: '0', '1' or unset")
    return jax.default_backend() == "gpu" if setting is None else setting == "1"


def unstack_layers(params: dict, axes: dict) -> dict:
    """Each param whose first axis is "layers" (in `axes`, models/model.py's param_axes) as an
    `Unstacked` of its L layers. Consumes `params`: each stacked array is deleted as it is
    split (see _split_array for how a GPU's memory is kept whole)."""
    start = time.perf_counter()
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_quantized)
    names = treedef.flatten_up_to(axes)
    for i, n in enumerate(names):
        if n[:1] == ("layers",) and isinstance(leaves[i], MixedGGUFWeight):
            leaves[i] = Unstacked(tuple(leaves[i].layer_weights()))  # slices of its formats
        elif n[:1] == ("layers",):
            arrays, param_def = jax.tree.flatten(leaves[i])
            per_array = [_split_array(a) for a in arrays]  # [array][layer]
            leaves[i] = Unstacked(tuple(param_def.unflatten(list(a)) for a in zip(*per_array)))
    logger.info(
        "split the layers' weights into one array per layer in %.1fs", time.perf_counter() - start
    )
    return treedef.unflatten(leaves)


def unstack_specs(specs: dict, axes: dict, shapes: dict) -> dict:
    """shard_map's in_specs for unstack_layers' params, from the stacked params' `specs`
    (distributed/tensor_parallel.py's param_specs): a "layers" param's spec without its first
    axis, once per layer of its stack (its first axis in `shapes`, models/model.py's
    param_shapes: a model may hold stacks of different lengths)."""

    def split(names: tuple, spec: PartitionSpec, shape: jax.ShapeDtypeStruct):
        if names[:1] != ("layers",):
            return spec
        return Unstacked((_layer_spec(spec),) * shape.shape[0])

    return jax.tree.map(split, axes, specs, shapes, is_leaf=lambda x: isinstance(x, tuple))


def _split_array(x: jax.Array, through_host: bool | None = None) -> list[jax.Array]:
    """x [L, ...] -> L arrays [...] on x's devices, sharded as x's trailing axes; x is deleted.

    On an accelerator (through_host None: any non-CPU array whose shards this process holds) x
    goes through host memory: copied out, deleted, then its layers put back one by one, so that
    they fill the space x left. Split on the device, x and its layers would lie there together
    (an MoE's expert stack is most of its weights), and the space x left, once freed, would be
    a hole the KV cache, one array allocated after, could not use."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        spec = _layer_spec(sharding.spec)
        sharding = NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
    if through_host is None:
        on_cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
        through_host = x.is_fully_addressable and not on_cpu
    if through_host:
        host = np.asarray(x)  # [L, ...], waits for the copy
        x.delete()
        return [jax.device_put(layer, sharding) for layer in host]
    layers = _split_on_device(x.shape[0], sharding)(x)
    jax.block_until_ready(layers)
    x.delete()
    return layers


def _layer_spec(spec: PartitionSpec) -> PartitionSpec:
    """A stacked param's spec without its layers axis, which no mesh axis cuts."""
    assert spec[:1] in ((), (None,)), f"the layers axis is sharded: {spec}"
    return PartitionSpec(*spec[1:])


@functools.cache
def _split_on_device(num_layers: int, sharding) -> Callable:
    return jax.jit(lambda x: [x[i] for i in range(num_layers)], out_shardings=sharding)


def num_stacked_layers(layers: nnx.Module) -> int:
    """L of a stacked_layers module, stacked or split by unstack_layers."""
    first = jax.tree.leaves(nnx.state(layers), is_leaf=is_unstacked)[0]
    return len(first.layers) if is_unstacked(first) else first.shape[0]


def scan_layers(
    layers: nnx.Module,
    body: Callable[[nnx.Module, Any, jax.Array, Any], Any],
    carry: Any,
    per_layer: Any = None,
) -> Any:
    """carry = body(layer module, carry, layer index i32[], per_layer[i]) for each layer in turn.

    `layers` comes from stacked_layers, holding [L, ...] weights or unstack_layers' per-layer
    ones; `per_layer` is a pytree of [L, ...] arrays (e.g. each layer's sliding window) sliced
    along with the weights. Returns the last carry; the rows of expert counts its layers made
    go to the forward's count (layers/expert_counts.py).
    """
    graphdef, state = nnx.split(layers)
    first = jax.tree.leaves(state, is_leaf=is_unstacked)[0]
    if is_unstacked(first):
        rows = []
        for i in range(len(first.layers)):
            weights = jax.tree.map(lambda w, i=i: w.layers[i], state, is_leaf=is_unstacked)
            extra = jax.tree.map(lambda a, i=i: a[i], per_layer)
            module = nnx.merge(graphdef, weights)
            carry, row = counted_layer(functools.partial(body, module, carry, jnp.int32(i), extra))
            rows.append(row)
        add_stack(None if rows[0] is None else jnp.stack(rows))
        return carry

    # Layers' inputs captured for a draft head (layers/hidden_capture.py) ride in the carry.
    capture = active_capture()

    def step(carry, xs):
        layer, extra = xs
        if capture is not None:
            carry, capture.rows = carry
        # The barrier ties the stacked weights to the layer index, so that XLA cannot hoist
        # work on them out of the loop: it converted every bfloat16 layer to float32 before the
        # loop, each step (a SmolLM2 decode step 15x slower on CPU).
        weights, layer = jax.lax.optimization_barrier((state, layer))
        weights = jax.tree.map(lambda w: _at_layer(w, layer), weights, is_leaf=is_quantized)
        # A layer's expert counts (layers/expert_counts.py) leave the scan as its output [L, E].
        carry, row = counted_layer(lambda: body(nnx.merge(graphdef, weights), carry, layer, extra))
        return (carry if capture is None else (carry, capture.rows)), row

    layer_ids = jnp.arange(first.shape[0], dtype=jnp.int32)
    init = carry if capture is None else (carry, capture.rows)
    carry, rows = jax.lax.scan(step, init, (layer_ids, per_layer))
    if capture is not None:
        carry, capture.rows = carry
    add_stack(rows)
    return carry


def _at_layer(
    w: jax.Array | QuantizedWeight, layer: jax.Array
) -> jax.Array | LayerWeight | QuantizedWeight:
    """Layer i32[] of a stacked weight: a quantized one keeps its stacked fields and the index,
    and so does a float one the CPU dense kernel can read (as a LayerWeight), so that a CPU
    kernel (quantization/cpu_gguf.py, cpu_int8.py, cpu_dense.py) reads the layer in place;
    any other is sliced."""
    if is_quantized(w):
        return w.at_layer(layer)
    if w.ndim == 3 and cpu_dense.supports(w.dtype, w.shape[-1], 1):
        return LayerWeight(w, layer)
    return jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
