"""The native CPU kernel for rows times a packed GGUF weight (jvllm/native/cpu_gguf.cc):
its values are gguf's bit for bit, in its own products of up to MAX_ROWS rows and in the layer
it dequantizes for XLA's matmul of more; its products are those of the dequantized weight, and
the pure-JAX path it replaces gives the same products when it is off or cannot be built."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_gguf_blocks

from jvllm.quantization import cpu_gguf
from jvllm.quantization.gguf_blocks import PACKED_QTYPES, split_fields
from jvllm.quantization.packed_weight import GGUFWeight

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernel with the system C++ compiler"
)
_NUM_LAYERS, _OUT = 3, 24


def _stacked_weight(qtype, num_blocks: int, dtype: str, seed: int = 0) -> GGUFWeight:
    """A random GGUF weight stacked [L, O, nb * block_size]."""
    rng = np.random.default_rng(seed + int(qtype))
    blocks = random_gguf_blocks(qtype, (_NUM_LAYERS * _OUT, num_blocks), rng)
    blocks = blocks.reshape(_NUM_LAYERS, _OUT, num_blocks)
    fields = {k: jnp.asarray(v) for k, v in split_fields(blocks, qtype).items()}
    return GGUFWeight(fields, int(qtype), dtype)


def _kernel(weight: GGUFWeight, x, layer: int):
    return jax.jit(cpu_gguf.dense, static_argnums=(3, 4))(
        x, weight.fields, jnp.int32(layer), weight.qtype, weight.dtype
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", PACKED_QTYPES, ids=lambda q: q.name)
def test_the_kernels_values_are_ggufs_bit_for_bit(qtype, dtype):
    """Rows of the identity pick out W's columns, so the products are W's values themselves:
    those of gguf's dequantize (jvllm's, checked against gguf in test_gguf_packed.py), rounded
    to bfloat16 in a bfloat16 model, at the layer asked for."""
    assert cpu_gguf.supports(dtype)
    weight = _stacked_weight(qtype, 2, dtype)
    num_in = weight.shape[-1]  # at least 64: more rows than the kernel's own
    for layer in (0, _NUM_LAYERS - 1):
        want = np.asarray(weight.at_layer(jnp.int32(layer)).dequantize().astype(dtype), np.float32)
        eye = np.eye(num_in, dtype=np.float32)
        # 32 rows a call, and 13 (the kernel's groups of 8, 4 and 1 rows).
        for step in (cpu_gguf.MAX_ROWS, 13):
            own = np.concatenate(
                [_kernel(weight, eye[i : i + step], layer) for i in range(0, num_in, step)]
            )
            # Equal as floats: bit for bit but for the sign of a zero (a sum's 0 + -0 is 0).
            assert np.array_equal(own.T, want)
        dequantized = np.asarray(_kernel(weight, eye, layer))
        assert np.array_equal(dequantized.T, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", PACKED_QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("num_rows", [cpu_gguf.MAX_ROWS, cpu_gguf.MAX_ROWS + 1])
def test_products_equal_the_dequantized_weights_and_rows_do_not_depend_on_the_batch(
    qtype, dtype, num_rows
):
    weight = _stacked_weight(qtype, 3, dtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((num_rows, weight.shape[-1])).astype(np.float32)
    x = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))  # values of the dtype
    layer = 1
    w = np.asarray(weight.at_layer(jnp.int32(layer)).dequantize().astype(dtype), np.float64)
    want = x.astype(np.float64) @ w.T  # [R, O]
    got = _kernel(weight, x, layer)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30)
    if num_rows <= cpu_gguf.MAX_ROWS:  # the kernel's sums are the same in any batch
        for first, count in ((0, 1), (5, 3), (3, 2), (17, 5), (1, 31)):
            rows = slice(first, first + count)
            assert np.array_equal(_kernel(weight, x[rows], layer), got[rows])


@pytest.mark.parametrize("num_rows", [1, 3, cpu_gguf.MAX_ROWS + 5])
def test_the_pure_jax_path_gives_the_same_products_with_the_kernel_off(num_rows, monkeypatch):
    """GGUFWeight.dense at a scanned layer, kernel on and off (as on a machine where it cannot
    be built; test_native.py): the one-row multiply-reduce and the dequantize-and-matmul of
    more rows compute the same sums in another order."""
    from gguf.constants import GGMLQuantizationType as Q

    weight = _stacked_weight(Q.Q4_1, 4, "float32")
    x = np.random.default_rng(2).standard_normal((num_rows, weight.shape[-1])).astype(np.float32)
    dense = lambda w, x, layer: w.at_layer(layer).dense(x)
    on = jax.jit(dense)(weight, x, jnp.int32(2))
    monkeypatch.setenv("JVLLM_CPU_GGUF_KERNEL", "0")
    assert not cpu_gguf.supports("float32")
    off = jax.jit(lambda w, x, layer: dense(w, x, layer))(weight, x, jnp.int32(2))
    np.testing.assert_allclose(on, off, rtol=2e-5, atol=2e-5)
