"""Rotary position embeddings in HF's rotate-half convention (first half / second half of H)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig, RopeScaling


def _llama3_scale(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3's frequency remap: keep high frequencies, divide low ones by `factor`, and blend
    linearly (in 1 / wavelength) between the two bands."""
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(
        wavelen > low_freq_wavelen,
        inv_freq / scaling.factor,
        np.where(wavelen < high_freq_wavelen, inv_freq, blended),
    )


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """f32[H/2] rotation speed of each pair of dims. NumPy: the config is static under jit, so
    this becomes a constant of the compiled program."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions i32[T] -> (cos, sin), each f32[T, H]."""
    inv_freq = jnp.asarray(inverse_frequencies(config))  # [H/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, H]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, H] rotated by (cos, sin) [T, H]; computed and returned in float32."""
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [T, heads, H]
    return x * cos[:, None, :] + rotated * sin[:, None, :]
