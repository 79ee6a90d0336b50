"""The native CPU kernel for bfloat16 rows times int8 weight values (jvllm/quantization/
cpu_int8.cc): its products are those of the values converted to bfloat16, at the layer asked
for, whatever the batch, and the pure-JAX path gives the same with the kernel off."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import native
from jvllm.quantization import cpu_int8
from jvllm.quantization.channel_weight import quantize_channels

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not native.cpu_has("avx512_bf16"),
    reason="builds the kernel with the system C++ compiler, for a CPU with AVX-512 BF16",
)
_NUM_LAYERS = 3


def _values(num_out: int, num_in: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(-128, 128, (_NUM_LAYERS, num_out, num_in)), jnp.int8)


def _rows(num_rows: int, num_in: int, seed: int = 1) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal((num_rows, num_in))
    return jnp.asarray(x, jnp.bfloat16)


_kernel = jax.jit(cpu_int8.dense)


def test_the_kernels_products_of_identity_rows_are_the_values_at_the_layer():
    values = _values(8, 64)
    assert cpu_int8.supports(cpu_int8.MAX_ROWS, values, "bfloat16")
    eye = jnp.eye(64, dtype=jnp.bfloat16)
    for layer in range(_NUM_LAYERS):
        got = np.asarray(_kernel(eye, values, jnp.int32(layer)))
        assert np.array_equal(got.T, np.asarray(values[layer], np.float32))


@pytest.mark.parametrize("num_rows", [1, 5, 6, 7, cpu_int8.MAX_ROWS])
@pytest.mark.parametrize("shape", [(12, 96), (40, 256)])
def test_products_equal_the_values_in_bfloat16_and_rows_do_not_depend_on_the_batch(num_rows, shape):
    values = _values(*shape)
    x = _rows(num_rows, shape[1])
    layer = 1
    x64, w64 = np.asarray(x, np.float64), np.asarray(values[layer], np.float64)
    got = np.asarray(_kernel(x, values, jnp.int32(layer)))
    scale = np.abs(x64) @ np.abs(w64).T
    assert np.all(np.abs(got - x64 @ w64.T) <= 1e-6 * scale)
    for rows in (slice(0, 1), slice(num_rows - 3, num_rows)):  # the same sums in any batch
        assert np.array_equal(np.asarray(_kernel(x[rows], values, jnp.int32(layer))), got[rows])


def test_a_layer_out_of_range_is_an_error_not_a_read_past_the_values():
    with pytest.raises(Exception, match="layer in"):
        _kernel(_rows(2, 64), _values(8, 64), jnp.int32(_NUM_LAYERS)).block_until_ready()


@pytest.mark.parametrize("num_rows", [1, 9])
def test_the_pure_jax_path_gives_the_same_products_with_the_kernel_off(num_rows, monkeypatch):
    """ChannelWeight.dense at a scanned layer, kernel on and off: the off path converts the
    values for XLA's matmul and sums in another order."""
    w = jax.random.normal(jax.random.key(0), (_NUM_LAYERS, 24, 128))
    weight = quantize_channels(w, "int8", "bfloat16")
    x = _rows(num_rows, 128)
    dense = lambda w, x, layer: w.at_layer(layer).dense(x)
    on = jax.jit(dense)(weight, x, jnp.int32(2))
    monkeypatch.setenv("JVLLM_CPU_INT8_KERNEL", "0")
    assert not cpu_int8.supports(num_rows, weight.values, "bfloat16")
    off = jax.jit(lambda w, x, layer: dense(w, x, layer))(weight, x, jnp.int32(2))
    np.testing.assert_allclose(on, off, rtol=1e-5, atol=1e-5)
