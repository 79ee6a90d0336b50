"""`load_format="dummy"`: random weights of a model's shapes, for benchmarks without a checkpoint.

As vLLM's dummy format: every weight uniform in [-1e-3, 1e-3]. Only the model's config.json is
read, and the arrays are drawn where they will live (on the accelerator, when there is one;
sharded over the mesh, each device drawing its own slice), so a model of any size is ready in
seconds. The outputs are meaningless; the work per token is the real model's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jvllm.config import ModelConfig
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.tensor_parallel import param_specs, sharded_param_shapes
from jvllm.models.model import param_shapes

_BOUND = 1e-3


def dummy_params(config: ModelConfig, seed: int = 0, mesh: Mesh | None = None) -> dict:
    """The params pytree of `config`'s shapes and dtypes (as `mesh` holds them, when given),
    each array drawn with its own key."""
    if mesh is None:
        shapes, shardings = param_shapes(config), None
    else:
        shapes = sharded_param_shapes(config, mesh.shape[TP_AXIS])
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(config))
    leaves, treedef = jax.tree.flatten(shapes)
    placements = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    arrays = [
        _draw(leaf.shape, jnp.dtype(leaf.dtype), sharding)(key)
        for key, leaf, sharding in zip(keys, leaves, placements)
    ]
    return jax.tree.unflatten(treedef, arrays)


@functools.cache
def _draw(shape: tuple[int, ...], dtype: jnp.dtype, sharding: NamedSharding | None):
    # Drawn in float32: bfloat16 draws would take only 128 distinct values in the range.
    return jax.jit(
        lambda key: jax.random.uniform(key, shape, jnp.float32, -_BOUND, _BOUND).astype(dtype),
        out_shardings=sharding,
    )
