"""fp8_weight.py: block scales broadcast over their blocks (a last block cut short), the values
rounded to the scale dtype inside jit, on a GPU a scheme's dynamic fp8 activations where a
scale covers whole rows (vLLM's FP8 W8A8 product), and on CPU the native kernel's values
(cpu_int_group.cc) dequantize's bit for bit."""

import shutil

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


def _random_bytes(rng, shape) -> jnp.ndarray:
    """float8_e4m3fn values of every byte but NaN's two, subnormals and zeros included."""
    bytes_ = rng.integers(0, 256, shape, dtype=np.uint8)
    bytes_[(bytes_ & 0x7F) == 0x7F] = 0x01
    return jax.lax.bitcast_convert_type(jnp.asarray(bytes_), jnp.float8_e4m3fn)


# (num_out, num_in, block): 128 x 64 blocks with a short last block of rows (150) and of
# columns (96 = 64 + 32, as SmolLM2's 576 in blocks of 128); a scale a row; one a weight.
_CPU_SHAPES = [(150, 96, (128, 64)), (40, 64, (1, 64)), (40, 96, (40, 96))]


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds the CPU kernel with g++")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("shape", _CPU_SHAPES, ids=lambda s: f"{s[2][0]}x{s[2][1]}")
def test_on_cpu_the_kernel_makes_the_values_of_dequantize_bit_for_bit(shape, scale_dtype, dtype):
    """Rows of the identity pick out the weight's columns, so the kernel's products (up to
    MAX_ROWS rows) and XLA's matmul of the layer the kernel dequantizes (more) are the values
    themselves, a stacked layer read where it lies."""
    num_out, num_in, block = shape
    rng = np.random.default_rng(num_out)
    grid = (3, -(-num_out // block[0]), -(-num_in // block[1]))
    scale = jnp.asarray(rng.uniform(0.01, 0.1, grid).astype(scale_dtype))
    stacked = FP8Weight(_random_bytes(rng, (3, num_out, num_in)), scale, block, dtype)
    dense = jax.jit(lambda w, x: w.dense(x))
    eye = jnp.eye(num_in, dtype=dtype)
    layer = stacked.at_layer(jnp.int32(2))
    assert "IntGroupDense" in dense.lower(layer, eye[:32]).compile().as_text()
    want = np.asarray(jax.jit(lambda w: w.dequantize())(layer), np.float32)  # [O, I]
    got = np.concatenate([dense(layer, eye[i : i + 32]) for i in range(0, num_in, 32)])
    assert np.array_equal(got.T, want)  # up to MAX_ROWS rows: the kernel's products
    assert np.array_equal(np.asarray(dense(layer, eye)).T, want)  # past: the kernel's layer


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds the CPU kernel with g++")
def test_on_cpu_a_nan_byte_makes_its_rows_products_nan_as_dequantize_does():
    rng = np.random.default_rng(0)
    bytes_ = np.array(jax.lax.bitcast_convert_type(_random_bytes(rng, (8, 64)), jnp.uint8))
    bytes_[2, 5], bytes_[6, 63] = 0x7F, 0xFF  # e4m3's two NaNs
    values = jax.lax.bitcast_convert_type(jnp.asarray(bytes_), jnp.float8_e4m3fn)
    w = FP8Weight(values, jnp.full((8, 1), 0.5, jnp.float32), (1, 64), "bfloat16")
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda w, x: w.dense(x))(w, x))  # [3, 8]
    assert np.isnan(got[:, [2, 6]]).all() and not np.isnan(np.delete(got, [2, 6], 1)).any()
    assert np.isnan(np.asarray(w.dequantize(), np.float32)[[2, 6]]).any(1).all()
