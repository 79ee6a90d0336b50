"""Rotary position embeddings over the first R dims of each head, in one of two layouts.

R = config.rotary_dim: the whole head H, or HF's `int(H * partial_rotary_factor)` for a family
that rotates part of each head (Phi-4-mini's 0.75); dims R..H pass through unchanged. The
rotated dims pair up as HF's rotate-half convention pairs them, dim i with dim i + R/2 (first
half / second half of the R), or, where `config.is_rope_interleaved` (GPT-J's rotate_every_two,
Cohere, GLM), dim 2i with dim 2i + 1. Either way pair i turns at frequency i. The flag is static,
so a rotate-half model compiles exactly the program it compiled before the option existed.
"""

import math
from collections.abc import Sequence

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
    attention factor (LongRoPE, YaRN). `local`: the sliding-window layers' base (Gemma 3).
    Laid out as apply_rope pairs the dims: pair i's angle at dims i and i + R/2 (rotate-half),
    or at dims 2i and 2i + 1 (`config.is_rope_interleaved`)."""
    inv_freq = jnp.asarray(inverse_frequencies(config, local))  # [R/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    return _angles_cos_sin(angles, config, local)


def mrope_cos_sin(
    positions: jax.Array, config: ModelConfig, sections: Sequence[int], interleaved: bool = False
) -> tuple[jax.Array, jax.Array]:
    """M-RoPE (Qwen2-VL): positions i32[3, T], each token's temporal, height and width
    positions -> (cos, sin), each f32[T, R] laid out as rope_cos_sin's. The R/2 pairs turn in
    `sections` (counts summing to R/2): the first sections[0] pairs by the temporal stream, the
    next sections[1] by the height one, the rest by the width one (HF's
    apply_multimodal_rotary_pos_emb); `interleaved` (Qwen3-VL): pair j turns by the height
    stream where j % 3 == 1 and j < 3 * sections[1], by the width one where j % 3 == 2 and
    j < 3 * sections[2], else by the temporal one. Three equal streams give rope_cos_sin's
    tables."""
    num_pairs = config.rotary_dim // 2
    if sum(sections) != num_pairs:
        raise ValueError(
            f"mrope_section {tuple(sections)} must sum to the {num_pairs} rotary "
            "pairs of a head (head_dim / 2)"
        )
    if interleaved:
        pair = np.arange(num_pairs)
        stream = np.zeros(num_pairs, np.int64)  # [R/2]: each pair's stream
        for s in (1, 2):
            stream[(pair % 3 == s) & (pair < 3 * sections[s])] = s
    else:
        stream = np.repeat(np.arange(len(sections)), sections)
    inv_freq = jnp.asarray(inverse_frequencies(config))  # [R/2]
    pair_positions = positions[jnp.asarray(stream)].T.astype(jnp.float32)  # [T, R/2]
    return _angles_cos_sin(pair_positions * inv_freq[None, :], config, local=False)


def _angles_cos_sin(
    angles: jax.Array, config: ModelConfig, local: bool
) -> tuple[jax.Array, jax.Array]:
    """Each pair's angle f32[T, R/2] -> (cos, sin) f32[T, R], in rope_cos_sin's layout and
    scale."""
    if config.is_rope_interleaved:
        angles = jnp.repeat(angles, 2, axis=-1)  # [T, R]: a0 a0 a1 a1 ...
    else:
        angles = jnp.concatenate([angles, angles], axis=-1)  # [T, R]: a0 a1 ... a0 a1 ...
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scaling = None if local else config.rope_scaling
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rope(
    x: jax.Array, cos: jax.Array, sin: jax.Array, is_interleaved: bool = False
) -> jax.Array:
    """x [T, heads, H] with its first R dims rotated by (cos, sin) [T, R] (rope_cos_sin's, of
    the same layout) and dims R..H passed through unchanged, as HF's partial rotary embedding;
    R = H rotates the whole head. Rotate-half pairs dim i with dim i + R/2 (HF's Llama);
    `is_interleaved` pairs dim 2i with dim 2i + 1 (HF's GPT-J, Cohere, GLM). Computed and
    returned in float32."""
    x = x.astype(jnp.float32)
    rotary_dim = cos.shape[-1]  # R
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]  # [T, heads, R], [T, heads, H-R]
    if is_interleaved:
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]  # [T, heads, R/2] each
        rotated = jnp.stack([-odd, even], axis=-1).reshape(x_rot.shape)  # [T, heads, R]
    else:
        half = rotary_dim // 2
        rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    if x_pass.shape[-1] == 0:
        return out
    return jnp.concatenate([out, x_pass], axis=-1)  # [T, heads, H]
