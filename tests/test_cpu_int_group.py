"""The native CPU kernel for rows times a 4- or 8-bit grouped integer weight
(jvllm/native/cpu_int_group.cc): its values are int_weight.dequantize's in the model dtype bit
for bit, in its own products of up to MAX_ROWS rows and in the layer it dequantizes for XLA's
matmul of more; its products are those of the dequantized weight, at the layer asked for, and
a row's do not depend on its batch.

`benchmark()` times the kernel against the packed GGUF Q4_1 kernel on SmolLM2's shapes, by hand
(not a test): `PYTHONPATH=. taskset -c 0 python3 tests/test_cpu_int_group.py` for one thread,
without taskset for all of them.
"""

import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.quantization import cpu_int_group
from jvllm.quantization.int_weight import dequantize, pack

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernel with the system C++ compiler"
)
_NUM_LAYERS = 3
_SCALE_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
_kernel = jax.jit(cpu_int_group.dense, static_argnums=(5, 6, 7))


def _weight(
    num_out, num_in, bits, group_size, scale_dtype, is_asymmetric, seed=0, num_layers=_NUM_LAYERS
):
    """Random (packed, scale, zero) stacked [L, ...]: zero points over q's whole range and one
    past it (GPTQ's v1 convention reaches 2^bits); scales of either sign, their magnitudes in
    [2^-10, 2^-4], so that no product is a float16 subnormal (int_weight's reduce_precision
    flushes those to zero, float16 arithmetic and the kernel do not)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2**bits, (num_layers, num_out, num_in), dtype=np.uint8)
    groups = (num_layers, num_out, num_in // group_size)
    magnitude = 2.0 ** rng.uniform(-10, -4, groups)
    scale = jnp.asarray(magnitude * rng.choice([-1.0, 1.0], groups), scale_dtype)
    zero = rng.integers(0, 2**bits + 1, groups) if is_asymmetric else None
    return jnp.asarray(pack(q, bits)), scale, None if zero is None else jnp.asarray(zero, jnp.int16)


def _values(packed, scale, zero, layer, bits, dtype) -> jax.Array:
    """int_weight's values of the layer in the model dtype [O, I]."""
    own = None if zero is None else zero[layer]
    return dequantize(packed[layer], scale[layer], own, bits).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_dtype", _SCALE_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("is_asymmetric", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernels_values_are_int_weights_bit_for_bit(bits, is_asymmetric, scale_dtype, dtype):
    """Rows of the identity pick out W's columns, so the products are W's values themselves."""
    num_in, group_size = 96, 32
    assert cpu_int_group.supports(dtype, bits, group_size, scale_dtype)
    weight = _weight(20, num_in, bits, group_size, scale_dtype, is_asymmetric)
    eye = jnp.eye(num_in, dtype=jnp.float32)
    for layer in (0, _NUM_LAYERS - 1):
        want = np.asarray(_values(*weight, layer, bits, dtype), np.float32)
        args = (*weight, jnp.int32(layer), bits, group_size, dtype)
        # 32 rows a call, and 11 (the kernel's groups of 4, 2 and 1 rows).
        for step in (cpu_int_group.MAX_ROWS, 11):
            got = [_kernel(eye[i : i + step], *args) for i in range(0, num_in, step)]
            # Equal as floats: bit for bit but for the sign of a zero (a sum's 0 + -0 is 0).
            assert np.array_equal(np.concatenate(got).T, want)
        assert np.array_equal(np.asarray(_kernel(eye, *args)).T, want)  # dequantized


# (bits, group size or None for a whole row, scale dtype, asymmetric), shapes chosen at random.
_CASES = [
    (4, 32, jnp.float16, True),
    (4, 64, jnp.bfloat16, False),
    (4, 128, jnp.float32, True),
    (4, None, jnp.bfloat16, True),
    (8, 32, jnp.float32, False),
    (8, 64, jnp.float16, True),
    (8, 128, jnp.bfloat16, True),
    (8, None, jnp.float16, False),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"{c[0]}bit-g{c[1]}")
def test_products_equal_the_dequantized_weights_and_rows_do_not_depend_on_the_batch(case, dtype):
    bits, group_size, scale_dtype, is_asymmetric = case
    rng = np.random.default_rng(group_size or 0)
    num_groups = int(rng.integers(1, 5)) if group_size else 1
    num_in = group_size * num_groups if group_size else 32 * int(rng.integers(3, 12))
    group_size = group_size or num_in
    num_out = int(rng.integers(17, 80))
    weight = _weight(num_out, num_in, bits, group_size, scale_dtype, is_asymmetric, seed=bits)
    layer = int(rng.integers(0, _NUM_LAYERS))
    w = _values(*weight, layer, bits, dtype)
    args = (*weight, jnp.int32(layer), bits, group_size, dtype)
    for num_rows in (1, 3, cpu_int_group.MAX_ROWS, cpu_int_group.MAX_ROWS + 5):
        x = jnp.asarray(rng.standard_normal((num_rows, num_in)), jnp.float32)
        got = np.asarray(_kernel(x, *args))
        rows = np.asarray(x.astype(dtype), np.float64)  # the kernel's rows, in the model dtype
        want = rows @ np.asarray(w, np.float64).T
        bound = np.abs(rows) @ np.abs(np.asarray(w, np.float64)).T
        assert np.all(np.abs(got - want) <= 1e-5 * bound + 1e-30)
        if num_rows <= cpu_int_group.MAX_ROWS:  # the kernel's sums are the same in any batch
            for first in range(0, num_rows, 3):
                assert np.array_equal(_kernel(x[first : first + 3], *args), got[first : first + 3])


def test_weights_the_kernel_does_not_take_are_refused(monkeypatch):
    assert not cpu_int_group.supports("float16", 4, 128, jnp.float16)
    assert not cpu_int_group.supports("float32", 3, 128, jnp.float16)
    assert not cpu_int_group.supports("float32", 4, 48, jnp.float16)
    assert not cpu_int_group.supports("float32", 4, 128, jnp.int8)
    packed, scale, zero = _weight(8, 128, 4, 64, jnp.float16, True)
    with pytest.raises(ValueError, match=r"scale must be \(3, 8, 4\)"):
        cpu_int_group.dense(jnp.ones((1, 128)), packed, scale, zero, 0, 4, 32, "float32")
    with pytest.raises(ValueError, match=r"x must be \[R, 128\]"):
        cpu_int_group.dense(jnp.ones((1, 64)), packed, scale, zero, 0, 4, 64, "float32")
    monkeypatch.setenv("JVLLM_CPU_INT_GROUP_KERNEL", "0")
    assert not cpu_int_group.supports("float32", 4, 128, jnp.float16)


def benchmark(
    scale_dtype=jnp.bfloat16, is_asymmetric=False, num_repeats=20, stack_bytes=64 << 20
) -> None:
    """Batch-1 microseconds a layer: the kernel on a W4A16 weight (group 128, or 64 where 128
    does not divide the inputs), XLA's matmul of it dequantized by int_weight.dequantize, and
    cpu_gguf.dense on a Q4_1 weight of the same shape; over a stack of layers larger than the
    cache (`stack_bytes` of Q4_1), in a scan as the model runs them; the best of
    `num_repeats`."""
    from conftest import random_gguf_blocks
    from gguf.constants import GGMLQuantizationType as Q

    from jvllm.quantization.gguf_blocks import split_fields

    rng = np.random.default_rng(0)
    print(f"cores this process may use: {len(os.sched_getaffinity(0))}")
    for num_in, num_out in ((576, 1536), (1536, 576), (576, 576)):
        num_layers = stack_bytes // (num_out * num_in // 32 * 20)
        blocks = random_gguf_blocks(Q.Q4_1, (num_layers * num_out, num_in // 32), rng)
        fields = split_fields(blocks.reshape(num_layers, num_out, -1), Q.Q4_1)
        fields = {k: jnp.asarray(v) for k, v in fields.items()}
        group_size = 128 if num_in % 128 == 0 else 64
        weight = _weight(num_out, num_in, 4, group_size, scale_dtype, is_asymmetric, 0, num_layers)
        for dtype in ("float32", "bfloat16"):
            x = jnp.asarray(rng.standard_normal((1, num_in)), dtype)
            kernels = _batch_one_kernels(x, weight, group_size, fields, dtype)
            figures = [
                f"{name} {_best_per_layer(kernel, num_layers, num_repeats):.1f} us"
                for name, kernel in kernels.items()
            ]
            shape = f"[{num_in} -> {num_out}] g{group_size} {dtype}"
            print(f"{shape:30s} {num_layers:4d} layers: " + ", ".join(figures))


def _batch_one_kernels(x, weight, group_size, fields, dtype) -> dict:
    """benchmark()'s contenders, each layer i32[] -> f32[1, O]."""
    from gguf.constants import GGMLQuantizationType as Q

    from jvllm.quantization import cpu_gguf
    from jvllm.quantization.dot import dot_rows

    return {
        "int_group": lambda i: cpu_int_group.dense(x, *weight, i, 4, group_size, dtype),
        "xla_dequantize": lambda i: dot_rows(x, _values(*weight, i, 4, dtype)),
        "gguf_q4_1": lambda i: cpu_gguf.dense(x.astype(jnp.float32), fields, i, Q.Q4_1, dtype),
    }


def _best_per_layer(layer_product, num_layers: int, num_repeats: int) -> float:
    """Microseconds a layer of `layer_product` over the layers of a scan, the best of
    `num_repeats` runs."""
    step = lambda total, i: (total + layer_product(i).sum(), None)
    run = jax.jit(lambda: jax.lax.scan(step, 0.0, jnp.arange(num_layers))[0])
    run().block_until_ready()
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        run().block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / num_layers * 1e6


if __name__ == "__main__":
    benchmark()
