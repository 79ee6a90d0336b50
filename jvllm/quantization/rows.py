"""Symmetric quantization of rows to a 1-byte format: what int8 / fp8 weights (per output
channel), activations (per token) and the quantized KV cache (per token and KV head) share."""

import jax
import jax.numpy as jnp

# The largest magnitude each format holds: e4m3fn's largest finite value; int8 kept symmetric.
MAX_VALUES = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.0}


def quantize_rows(x: jax.Array, dtype, scale_dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., N] -> (values dtype[..., N], scales scale_dtype[...]) with x ~= values * scales:
    each row's largest |x| maps to the format's largest value (a row of zeros gets scale 0 and
    values 0)."""
    max_value = MAX_VALUES[jnp.dtype(dtype)]
    x = x.astype(jnp.float32)
    scales = (jnp.max(jnp.abs(x), axis=-1) / max_value).astype(scale_dtype)
    scale = scales.astype(jnp.float32)[..., None]
    # Divided by the scale as stored: its rounding may take the largest value a hair past
    # max_value, which the clip takes back (e4m3fn has no infinity: it would be NaN).
    y = jnp.clip(x / jnp.where(scale > 0, scale, 1.0), -max_value, max_value)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scales
