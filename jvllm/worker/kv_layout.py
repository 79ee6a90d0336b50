"""The paged KV cache's layout: one array for the whole model, or with `kv_cache_dtype` "fp8" /
"int8" that array at one byte a value and a second one of scales (docs/design.md)."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from jvllm.attention.kv_quant import (
    SCALE_DTYPE,
    KVCache,
    QuantizedKVCache,
    bits_dtype,
    quantized_dtype,
)
from jvllm.config import ModelConfig
from jvllm.distributed.mesh import TP_AXIS
from jvllm.distributed.tensor_parallel import num_kv_heads


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """What the cache stores for each value of K and V, and the scales beside them."""

    name: str  # for the start-up log: the stored dtype, or the quantized kind
    dtype: jnp.dtype  # the values' array
    scale_dtype: jnp.dtype | None  # the scales' array [L, V, K, P, B]; None: not quantized

    def head_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one KV head."""
        scale_bytes = 0 if self.scale_dtype is None else self.scale_dtype.itemsize
        return head_dim * self.dtype.itemsize + scale_bytes


def kv_cache_spec(
    model_dtype: str, attention_backend: str, kv_cache_dtype: str = "auto"
) -> KVCacheSpec:
    """`kv_cache_dtype` "auto" stores the model dtype, except a bfloat16 cache for the reference
    backend on CPU, which stores the same bits as uint16: XLA:CPU copies a whole bfloat16 cache
    to float32 and back around every scatter into it (measured: 1.8 s a SmolLM2 decode step
    instead of 0.2 s). The reference backend converts only the pages it reads.

    "fp8" and "int8" store 1-byte values and bfloat16 scales (attention/kv_quant.py); on CPU the
    floats as their bits for both backends (the Pallas backend bitcasts them back)."""
    is_cpu = jax.default_backend() == "cpu"
    values = quantized_dtype(kv_cache_dtype)
    if values is None:
        dtype = jnp.dtype(model_dtype)
        if is_cpu and attention_backend == "reference":
            return KVCacheSpec(model_dtype, bits_dtype(dtype), None)
        return KVCacheSpec(model_dtype, dtype, None)
    name = (
        f"{kv_cache_dtype} ({values.name} values, a {SCALE_DTYPE.name} scale a token and KV head)"
    )
    if is_cpu:
        return KVCacheSpec(name, bits_dtype(values), bits_dtype(SCALE_DTYPE))
    return KVCacheSpec(name, values, SCALE_DTYPE)


def kv_cache_shape(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    num_shards: int = 1,
    num_slots: int | None = None,
) -> tuple[int, ...]:
    """[L, V, K, P, B, H] over all devices (V: config.kv_planes), L the `num_slots` layers a
    page holds where the layers are in hybrid KV groups (core/kv_groups.py); K counts the
    repeated KV heads when a model has fewer than its `num_shards` tensor-parallel devices
    (distributed/tensor_parallel.py)."""
    k = num_kv_heads(config, num_shards)
    num_layers = config.num_layers if num_slots is None else num_slots
    return (num_layers, config.kv_planes, k, num_blocks, block_size, config.head_dim)


def allocate_kv_cache(spec: KVCacheSpec, shape: tuple[int, ...], sharding: Sharding) -> KVCache:
    """A zero cache of `shape` [L, V, K, P, B, H] (and its scales [L, V, K, P, B])."""
    values = jnp.zeros(shape, spec.dtype, device=sharding)
    if spec.scale_dtype is None:
        return values
    return QuantizedKVCache(values, jnp.zeros(shape[:-1], spec.scale_dtype, device=sharding))


def new_kv_cache(
    config: ModelConfig,
    mesh: Mesh,
    partition: PartitionSpec,
    *,
    num_blocks: int,
    block_size: int,
    attention_backend: str,
    kv_cache_dtype: str,
    num_slots: int | None = None,
) -> KVCache:
    """A model's zero cache of `num_blocks` pages over the mesh, its KV heads cut over the
    tensor-parallel axis as `partition` places them (kv_cache_spec, kv_cache_shape)."""
    return allocate_kv_cache(
        kv_cache_spec(config.dtype, attention_backend, kv_cache_dtype),
        kv_cache_shape(config, num_blocks, block_size, mesh.shape[TP_AXIS], num_slots),
        NamedSharding(mesh, partition),
    )
