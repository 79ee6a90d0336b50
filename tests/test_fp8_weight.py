"""fp8_weight.py: block scales broadcast over their blocks (a last block cut short), the values
rounded to the scale dtype inside jit, and on a GPU a scheme's dynamic fp8 activations where a
scale covers whole rows (vLLM's FP8 W8A8 product)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jvllm.quantization.channel_weight import fp8_matmul
from jvllm.quantization.fp8_weight import FP8Weight


def _weight(rng, shape, block, scale_dtype=np.float32, **kwargs) -> FP8Weight:
    num_out, num_in = shape
    values = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    grid = (-(-num_out // block[0]), -(-num_in // block[1]))
    scale = rng.uniform(0.01, 0.1, grid).astype(scale_dtype)
    return FP8Weight(jnp.asarray(values), jnp.asarray(scale), block, "float32", **kwargs)


@pytest.mark.parametrize("block", [(128, 128), (1, 200), (72, 200), (16, 48)])
@pytest.mark.parametrize("scale_dtype", [np.float32, ml_dtypes.bfloat16])
def test_dequantize_scales_each_block_rounded_to_the_scale_dtype(block, scale_dtype):
    rng = np.random.default_rng(0)
    w = _weight(rng, (72, 200), block, scale_dtype)
    values, scale = np.asarray(w.values), np.asarray(w.scale)
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:72, :200]
    expected = (values.astype(scale_dtype) * full).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w.dequantize())(w)), expected)
    x = jnp.asarray(rng.normal(size=(3, 200)), jnp.float32)
    np.testing.assert_allclose(np.asarray(w.dense(x)), np.asarray(x) @ expected.T, rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_on_a_gpu_dynamic_fp8_activations_meet_a_per_row_scale_in_an_fp8_matmul(monkeypatch):
    rng = np.random.default_rng(1)
    w = _weight(rng, (40, 64), (1, 64), dynamic_activations=True)
    stacked = FP8Weight(w.values[None], w.scale[None], w.block, "float32",
                        dynamic_activations=True)  # fmt: skip
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    got = jax.jit(lambda w, x: w.at_layer(jnp.int32(0)).dense(x))(stacked, x)
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(fp8_matmul(x, w.values, w.scale[:, 0]))
    )
    # Close to the weight-only product: the activations' rounding to e4m3 is all that differs.
    weight_only = np.asarray(x) @ np.asarray(w.dequantize()).T
    assert np.abs(np.asarray(got) - weight_only).max() < 0.05 * np.abs(weight_only).max()
