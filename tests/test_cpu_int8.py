"""The native CPU kernel for bfloat16 rows times int8 weight values with per-row scales
(jvllm/native/cpu_int8.cc): up to MAX_ROWS rows its products are those of the exact values,
scaled; past them XLA multiplies by values * scales that the kernel's loop rounds to bfloat16;
both read the layer asked for, and the pure-JAX path gives the same with the kernel off."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.quantization import cpu_int8
from jvllm.quantization.channel_weight import quantize_channels

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernel with the system C++ compiler"
)
_NUM_LAYERS = 3
_KERNEL_ROWS = [1, 5, 6, 7, cpu_int8.MAX_ROWS]
_CONVERTED_ROWS = [cpu_int8.MAX_ROWS + 1]
# Past MAX_ROWS each weight is rounded to bfloat16 (a relative 2^-9) before the float32 sums.
_TOLERANCE = {False: 1e-6, True: 2.0**-8}


def _weight(num_out: int, num_in: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """values s8[L, O, I] and positive scales f32[L, O]."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-128, 128, (_NUM_LAYERS, num_out, num_in))
    scale = rng.uniform(0.5, 2.0, (_NUM_LAYERS, num_out))
    return jnp.asarray(values, jnp.int8), jnp.asarray(scale, jnp.float32)


def _rows(num_rows: int, num_in: int, seed: int = 1) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((num_rows, num_in))
    return jnp.asarray(x, jnp.bfloat16)


_kernel = jax.jit(cpu_int8.dense)


@pytest.mark.parametrize("num_in", [64, 4 * cpu_int8.MAX_ROWS])  # the kernel's rows; converted
def test_the_products_of_identity_rows_are_the_scaled_values_at_the_layer(num_in):
    values, _ = _weight(8, num_in)
    exponents = np.random.default_rng(2).integers(-3, 4, (_NUM_LAYERS, 8))
    scale = jnp.asarray(2.0**exponents, jnp.float32)  # powers of two: values * scale are exact
    assert cpu_int8.supports(values, "bfloat16")
    eye = jnp.eye(num_in, dtype=jnp.bfloat16)
    for layer in range(_NUM_LAYERS):
        got = np.asarray(_kernel(eye, values, scale, jnp.int32(layer)))
        want = np.asarray(values[layer], np.float32) * np.asarray(scale[layer])[:, None]
        assert np.array_equal(got.T, want)


@pytest.mark.parametrize("num_rows", _KERNEL_ROWS + _CONVERTED_ROWS)
@pytest.mark.parametrize("shape", [(12, 96), (40, 256)])
def test_products_equal_the_scaled_values_and_rows_do_not_depend_on_the_batch(num_rows, shape):
    values, scale = _weight(*shape)
    x = _rows(num_rows, shape[1])
    layer = 1
    w64 = np.asarray(values[layer], np.float64) * np.asarray(scale[layer], np.float64)[:, None]
    x64 = np.asarray(x, np.float64)
    got = np.asarray(_kernel(x, values, scale, jnp.int32(layer)))
    bound = _TOLERANCE[num_rows > cpu_int8.MAX_ROWS] * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(got - x64 @ w64.T) <= bound)
    if num_rows <= cpu_int8.MAX_ROWS:  # the kernel's sums are the same in any batch
        for rows in (slice(0, 1), slice(num_rows - 3, num_rows)):
            again = _kernel(x[rows], values, scale, jnp.int32(layer))
            assert np.array_equal(np.asarray(again), got[rows])


@pytest.mark.parametrize("num_rows", [2, cpu_int8.MAX_ROWS + 1])
def test_a_layer_out_of_range_is_an_error_not_a_read_past_the_values(num_rows):
    with pytest.raises(Exception, match="layer in"):
        _kernel(_rows(num_rows, 64), *_weight(8, 64), jnp.int32(_NUM_LAYERS)).block_until_ready()


@pytest.mark.parametrize("num_rows", [1, 9, cpu_int8.MAX_ROWS + 3])
def test_the_pure_jax_path_gives_the_same_products_with_the_kernel_off(num_rows, monkeypatch):
    """ChannelWeight.dense at a scanned layer, kernel on and off: the off path converts the
    values for XLA's matmul, sums in another order and scales the sums."""
    w = jax.random.normal(jax.random.key(0), (_NUM_LAYERS, 24, 128))
    weight = quantize_channels(w, "int8", "bfloat16")
    x = _rows(num_rows, 128)
    dense = lambda w, x, layer: w.at_layer(layer).dense(x)
    on = jax.jit(dense)(weight, x, jnp.int32(2))
    monkeypatch.setenv("JVLLM_CPU_INT8_KERNEL", "0")
    assert not cpu_int8.supports(weight.values, "bfloat16")
    off = jax.jit(lambda w, x, layer: dense(w, x, layer))(weight, x, jnp.int32(2))
    w64 = np.asarray(weight.values[2], np.float64) * np.asarray(weight.scale[2])[:, None]
    bound = _TOLERANCE[num_rows > cpu_int8.MAX_ROWS] * (
        np.abs(np.asarray(x, np.float64)) @ np.abs(w64).T
    )
    assert np.all(np.abs(np.asarray(on) - np.asarray(off)) <= 2 * bound + 1e-6)
