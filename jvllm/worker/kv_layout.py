"""The paged KV array's layout: one array for the whole model (docs/design.md)."""

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.distributed.tensor_parallel import num_kv_heads


def kv_cache_dtype(model_dtype: str, attention_backend: str) -> jnp.dtype:
    """The KV cache stores the model dtype, except a bfloat16 cache for the reference backend on
    CPU, which stores the same bits as uint16: XLA:CPU copies a whole bfloat16 cache to float32
    and back around every scatter into it (measured: 1.8 s a SmolLM2 decode step instead of
    0.2 s). The reference backend converts only the pages it reads."""
    if model_dtype != "bfloat16":
        return jnp.dtype(jnp.float32)
    if attention_backend == "reference" and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.uint16)
    return jnp.dtype(jnp.bfloat16)


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int, num_shards: int = 1
) -> tuple[int, ...]:
    """[L, 2, K, P, B, H] over all devices; K counts the repeated KV heads when a model has
    fewer than its `num_shards` tensor-parallel devices (distributed/tensor_parallel.py)."""
    k = num_kv_heads(config, num_shards)
    return (config.num_layers, 2, k, num_blocks, block_size, config.head_dim)
