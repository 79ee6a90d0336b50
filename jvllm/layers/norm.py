"""RMSNorm, computed in float32 whatever the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalise over the last axis: x / rms(x) * weight. Returns float32.

    The statistics are taken in float32 because a bfloat16 mean of squares loses the small
    activations that RMSNorm exists to rescale.
    """
    x = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight.astype(jnp.float32)
