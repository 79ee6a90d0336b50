"""RMSNorm and LayerNorm, computed in float32 whatever the input dtype."""

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.params import param


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalise over the last axis: x / rms(x) * weight. Returns float32.

    The statistics are taken in float32 because a bfloat16 mean of squares loses the small
    activations that RMSNorm exists to rescale.
    """
    x = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight.astype(jnp.float32)


class RMSNorm(nnx.Module):
    """rms_norm over the last axis with a float32 weight [size] (tiny, and it feeds float32
    math, so it stays float32 whatever the model dtype). Gemma scales by (1 + weight):
    `weight_offset` 1."""

    def __init__(self, size: int, eps: float, axis: str = "embed", weight_offset: float = 0.0):
        self.weight = param((size,), jnp.float32, (axis,))
        self.eps = eps
        self.weight_offset = weight_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...] + self.weight_offset, self.eps)


def layer_norm(
    x: jax.Array, weight: jax.Array | None, bias: jax.Array | None, eps: float
) -> jax.Array:
    """Normalise over the last axis to zero mean and unit variance, then * weight + bias (each
    optional). Returns float32; the statistics are float32 for the reason rms_norm's are."""
    x = x.astype(jnp.float32)
    centered = x - jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(variance + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y if bias is None else y + bias.astype(jnp.float32)


class LayerNorm(nnx.Module):
    """layer_norm over the last axis with a float32 weight and bias [size] (float32 as RMSNorm's),
    the weight alone without `bias` (Cohere's), or neither when not `is_affine` (OPT's
    layer_norm_elementwise_affine=False); `axis` names the size (a head's q/k norm: "head_dim")."""

    def __init__(
        self,
        size: int,
        eps: float,
        *,
        is_affine: bool = True,
        bias: bool = True,
        axis: str = "embed",
    ):
        self.weight = param((size,), jnp.float32, (axis,)) if is_affine else None
        self.bias = param((size,), jnp.float32, (axis,)) if is_affine and bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = None if self.weight is None else self.weight[...]
        bias = None if self.bias is None else self.bias[...]
        return layer_norm(x, weight, bias, self.eps)
