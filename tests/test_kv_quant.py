"""The quantized KV cache (kv_cache_dtype "fp8" / "int8"): the format's round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.kv_quant import (
    bits_dtype,
    dequantize,
    from_storage,
    quantize,
    quantized_dtype,
    to_storage,
)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantize_round_trip_stays_within_each_rows_step(kv_cache_dtype):
    """Rows of magnitudes from 1e-3 to 1e3, an outlier and a row of zeros: each row's error is
    bounded by its own scale (int8: half a step; fp8: 3 mantissa bits), plus what the bfloat16
    rounding of the scale may clip off the largest value."""
    dtype = quantized_dtype(kv_cache_dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4, 128)) * np.exp(rng.uniform(-7, 7, (64, 4, 1)))
    x[0, 0] = 0.0
    x[1, 1, 3] = 1e4
    values, scales = quantize(jnp.asarray(x, jnp.float32), dtype)
    assert (values.dtype, values.shape) == (dtype, x.shape)
    assert (scales.dtype, scales.shape) == (jnp.bfloat16, x.shape[:2])
    err = np.abs(np.asarray(dequantize(values, scales)) - x)
    step = np.asarray(scales, np.float32)[..., None]
    amax = np.abs(x).max(-1, keepdims=True)
    if kv_cache_dtype == "int8":
        bound = 0.5 * step + amax * 2**-8
    else:  # half an e4m3 ulp, 2**-10 in its subnormals
        bound = np.abs(x) * 2**-4 + step * 2**-10 + amax * 2**-8
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err <= amax / 16).all()
    np.testing.assert_array_equal(np.asarray(dequantize(values, scales))[0, 0], 0.0)
    # As a CPU cache stores them (float8 and bfloat16 as bits) and back, bit for bit.
    for a in (values, scales):
        stored = to_storage(a, bits_dtype(a.dtype))
        assert stored.dtype.itemsize == a.dtype.itemsize
        np.testing.assert_array_equal(np.asarray(from_storage(stored) == a), True)
