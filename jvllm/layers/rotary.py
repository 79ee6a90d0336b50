"""Rotary position embeddings in HF's rotate-half convention, over the first R dims of each head.

R = config.rotary_dim: the whole head H, or HF's `int(H * partial_rotary_factor)` for a family
that rotates part of each head (Phi-4-mini's 0.75). The rotated dims pair dim i with dim i + R/2
(first half / second half of the R); dims R..H pass through unchanged.
"""

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


def _yarn_scale(inv_freq: np.ndarray, scaling: RopeScaling, dim: int, theta: float) -> np.ndarray:
    """YaRN (HF's `_compute_yarn_parameters`): frequency i keeps its value (extrapolation) below
    the index `low`, is divided by `factor` (interpolation) above `high`, and blends linearly
    between; `low` / `high` are the (fractional) indices whose wavelengths fit `beta_fast` /
    `beta_slow` turns into the original context."""
    original = scaling.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = np.clip((np.arange(len(inv_freq), dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the weight of the unscaled frequency
    return inv_freq / scaling.factor * ramp + inv_freq * extrapolation


def inverse_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """f32[R/2] rotation speed of each pair of rotated dims (of the sliding-window layers' own
    base when `local`). NumPy: the config is static under jit, so this becomes a constant of
    the compiled program."""
    theta = config.local_rope_theta if local else config.rope_theta
    dim = config.rotary_dim  # R
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
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
    if scaling is not None and scaling.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, scaling, dim, theta)
    # "dynamic": the unscaled frequencies, HF's within max_position_embeddings (RopeScaling).
    return inv_freq.astype(np.float32)


def rope_cos_sin(
    positions: jax.Array, config: ModelConfig, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """positions i32[T] -> (cos, sin), each f32[T, R] over the R = config.rotary_dim rotated
    dims of a head (R = H unless the family rotates part of it); scaled by the rope scaling's
    attention factor (LongRoPE, YaRN). `local`: the sliding-window layers' base (Gemma 3)."""
    inv_freq = jnp.asarray(inverse_frequencies(config, local))  # [R/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, R]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, H] with its first R dims rotated by (cos, sin) [T, R] (rotate-half within
    those R: dim i pairs with dim i + R/2) and dims R..H passed through unchanged, as HF's
    partial rotary embedding; R = H rotates the whole head. Computed and returned in float32."""
    x = x.astype(jnp.float32)
    rotary_dim = cos.shape[-1]  # R
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # [T, heads, R], [T, heads, H-R]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)  # [T, heads, R]
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    if x_pass.shape[-1] == 0:
        return out
    return jnp.concatenate([out, x_pass], axis=-1)  # [T, heads, H]
