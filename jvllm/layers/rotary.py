"""Rotary position embeddings in HF's rotate-half convention (first half / second half of H)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.rope_config import RopeScaling


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


def inverse_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """f32[H/2] rotation speed of each pair of dims (of the sliding-window layers' own base
    when `local`). NumPy: the config is static under jit, so this becomes a constant of the
    compiled program."""
    theta = config.local_rope_theta if local else config.rope_theta
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    if scaling is not None and scaling.rope_type == "longrope":
        # One set for all positions: see RopeScaling.use_long_factor for why not per length.
        factors = scaling.long_factor if scaling.use_long_factor else scaling.short_factor
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    return inv_freq.astype(np.float32)


def rope_cos_sin(
    positions: jax.Array, config: ModelConfig, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """positions i32[T] -> (cos, sin), each f32[T, H]; `local`: the sliding-window layers'
    base (Gemma 3)."""
    inv_freq = jnp.asarray(inverse_frequencies(config, local))  # [H/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, H]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, H] rotated by (cos, sin) [T, H]; computed and returned in float32."""
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [T, heads, H]
    return x * cos[:, None, :] + rotated * sin[:, None, :]
