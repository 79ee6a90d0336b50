"""`load_format="dummy"`: random weights of a model's shapes, for benchmarks without a checkpoint.

As vLLM's dummy format: every weight uniform in [-1e-3, 1e-3]. Only the model's config.json is
read, and the arrays are drawn where JAX puts them (on the accelerator, when there is one), so a
model of any size is ready in seconds. The outputs are meaningless; the work per token is the real
model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.model import param_shapes

_BOUND = 1e-3


def dummy_params(config: ModelConfig, seed: int = 0) -> dict:
    """The params pytree of `config`'s shapes and dtypes, each array drawn with its own key."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    # Drawn in float32: bfloat16 draws would take only 128 distinct values in the range.
    arrays = [
        jax.random.uniform(key, leaf.shape, jnp.float32, -_BOUND, _BOUND).astype(leaf.dtype)
        for key, leaf in zip(keys, leaves)
    ]
    return jax.tree.unflatten(treedef, arrays)
