"""int_weight.py's layout: packing round-trips, dequantization is the formula (q - z) * s rounded
to the scale dtype, and every dense path (one row on CPU in packed order, more rows through the
dequantized matmul, a stacked layer inside jit, act-order's permuted columns) equals x times the
dequantized weight."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jvllm.quantization.host_weights import int_weight, stack
from jvllm.quantization.int_weight import IntWeight, dequantize, pack, rounded, unpack


def _weight(rng, shape, bits, group_size, symmetric, scale_dtype):
    """Unsigned values, scales and zero points of `shape` [..., O, I]."""
    *lead, num_out, num_in = shape
    values = rng.integers(0, 1 << bits, shape)
    scale = rng.uniform(0.001, 0.02, (*lead, num_out, num_in // group_size)).astype(scale_dtype)
    zero = None if symmetric else rng.integers(0, 1 << bits, scale.shape).astype(np.int16)
    return values, scale, zero


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_in_column_order(bits):
    values = np.random.default_rng(0).integers(0, 1 << bits, (3, 96))
    packed = pack(values, bits)
    assert packed.shape == (3, 96 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack(jnp.asarray(packed), bits), values)


@pytest.mark.parametrize("scale_dtype", [np.float16, ml_dtypes.bfloat16])
def test_dequantize_rounds_each_value_to_the_scale_dtype_inside_jit(scale_dtype):
    """The reference's arithmetic: (q - z) in the scale dtype times s, one rounding; jit must
    not keep the float32 product (XLA's excess precision)."""
    rng = np.random.default_rng(1)
    values, scale, zero = _weight(rng, (8, 64), 4, 32, False, scale_dtype)
    expected = (values - np.repeat(zero, 32, axis=1)).astype(scale_dtype) * np.repeat(
        scale, 32, axis=1
    )
    got = jax.jit(dequantize, static_argnums=3)(
        jnp.asarray(pack(values, 4)), jnp.asarray(scale), jnp.asarray(zero), 4
    )
    assert got.dtype == scale_dtype
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, 64, 96])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("native", ["1", "0"])
def test_dense_equals_x_times_the_dequantized_layer(
    bits, group_size, symmetric, num_rows, native, monkeypatch
):
    """Through the CPU kernel (cpu_int_group.py, groups of 32's multiples) and XLA's nibble
    planes (JVLLM_CPU_INT_GROUP_KERNEL=0, and groups of 16 or 96)."""
    monkeypatch.setenv("JVLLM_CPU_INT_GROUP_KERNEL", native)
    rng = np.random.default_rng(2)
    values, scale, zero = _weight(rng, (3, 40, 192), bits, group_size, symmetric, np.float16)
    w = IntWeight(
        jnp.asarray(pack(values, bits)),
        jnp.asarray(scale),
        None if zero is None else jnp.asarray(zero),
        None,
        bits,
        group_size,
        "bfloat16",
    )
    x = jnp.asarray(rng.normal(size=(num_rows, 192)), jnp.bfloat16)
    layer = jnp.int32(2)
    got = jax.jit(lambda w, x, layer: w.at_layer(layer).dense(x))(w, x, layer)
    dequantized = np.asarray(w.dequantize()[2], np.float32)  # [O, I] in bfloat16 values
    expected = np.asarray(x, np.float32) @ dequantized.T
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_act_order_columns_are_stored_by_group_and_x_follows_them():
    """GPTQ's g_idx: column i belongs to group g_idx[i]; the weight stores the columns sorted
    by group and multiplies x's columns in the same order."""
    rng = np.random.default_rng(3)
    values, scale, _ = _weight(rng, (24, 64), 4, 32, True, np.float16)
    g_idx = rng.permutation(np.arange(64) // 32)
    host = int_weight(values, scale, None, 4, 32, g_idx)
    w = IntWeight(jnp.asarray(host.packed), jnp.asarray(scale), None, jnp.asarray(host.perm), 4,
                  32, "float32")  # fmt: skip
    # The reference: column i scaled by its own group's scale, centred on 8.
    reference = (values - 8).astype(np.float16) * scale[:, g_idx]
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    expected = np.asarray(x) @ reference.astype(np.float32).T
    np.testing.assert_allclose(np.asarray(jax.jit(lambda w, x: w.dense(x))(w, x)), expected,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    np.testing.assert_allclose(np.asarray(w.dense(x[:1])), expected[:1], rtol=1e-5, atol=1e-5)


def test_unequal_act_order_groups_are_refused():
    values = np.zeros((4, 64), np.uint8)
    scale = np.ones((4, 2), np.float16)
    with pytest.raises(ValueError, match="g_idx gives groups of"):
        int_weight(values, scale, None, 4, 32, np.r_[np.zeros(40), np.ones(24)].astype(int))


def test_on_a_gpu_the_pallas_dequantizing_matmul_reads_the_stacked_layer(monkeypatch):
    """The GPU branch's call into kernels_pallas (run in interpret mode here): the stacked
    fields and the layer index go in as they are, and the product is the dequantized one."""
    from kernels_pallas import dequant_matmul

    calls = []

    def interpreted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs, interpret=True)

    real = dequant_matmul.int_matmul
    monkeypatch.setattr(dequant_matmul, "int_matmul", interpreted)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(4)
    values, scale, zero = _weight(rng, (2, 48, 128), 4, 64, False, ml_dtypes.bfloat16)
    w = IntWeight(jnp.asarray(pack(values, 4)), jnp.asarray(scale), jnp.asarray(zero), None, 4,
                  64, "bfloat16")  # fmt: skip
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.bfloat16)
    got = w.at_layer(jnp.int32(1)).dense(x)
    assert calls and calls[0]["group_size"] == 64 and calls[0]["layer"] is not None
    expected = np.asarray(x, np.float32) @ np.asarray(w.dequantize()[1], np.float32).T
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_rounding_to_float16_keeps_its_subnormals():
    """A tiny scale times a small integer falls below float16's normal range: float16 (and the
    format's reference) keeps it as a subnormal, which XLA's reduce_precision would flush."""
    x = np.array([3e-6, 5e-5, 1e-7, 6.103e-5, -2e-6, 3.0e-8, 2.9e-8, 1.0001, 6e4], np.float32)
    got = jax.jit(lambda x: rounded(x, jnp.float16))(x)
    np.testing.assert_array_equal(np.asarray(got), x.astype(np.float16))


def test_a_stack_whose_experts_differ_in_act_order_stays_packed():
    """An expert GPTQ left in column order (no calibration tokens reached it) beside permuted
    ones: its order is the identity, and the stack stays one packed weight."""
    rng = np.random.default_rng(5)
    values, scale, _ = _weight(rng, (8, 64), 4, 32, True, np.float16)
    in_order = int_weight(values, scale, None, 4, 32, np.arange(64) // 32)
    permuted = int_weight(values, scale, None, 4, 32, rng.permutation(np.arange(64) // 32))
    assert in_order.perm is None and permuted.perm is not None
    stacked = stack([in_order, permuted])
    assert stacked is not None
    np.testing.assert_array_equal(stacked.perm[0], np.arange(64))
    np.testing.assert_array_equal(stacked.perm[1], permuted.perm)


def test_zero_points_of_another_shape_than_the_scales_are_refused():
    values = np.zeros((16, 64), np.uint8)
    scale = np.ones((16, 2), np.float16)
    with pytest.raises(ValueError, match="needs zero points of that shape"):
        int_weight(values, scale, np.zeros((2, 2), np.int16), 4, 32)


def test_act_order_by_column_form_holds_the_same_weight():
    """by_column (the form a cut along the input axis takes): the checkpoint's column order with
    each column's group, equal to the sorted form's weight with its columns put back."""
    rng = np.random.default_rng(6)
    values, scale, zero = _weight(rng, (2, 24, 64), 4, 32, False, np.float16)
    hosts = [
        int_weight(values[i], scale[i], zero[i], 4, 32, rng.permutation(np.arange(64) // 32))
        for i in range(2)
    ]
    sorted_form = stack(hosts)
    column_form = sorted_form.by_column()
    assert column_form.perm is None and column_form.g_idx.shape == (2, 64)
    expected = sorted_form.dequantize()  # columns put back in checkpoint order
    w = IntWeight(*(jnp.asarray(getattr(column_form, f)) for f in ("packed", "scale", "zero")),
                  None, 4, 32, "float32", g_idx=jnp.asarray(column_form.g_idx))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w.dequantize())(w)), expected)
    x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    got = jax.jit(lambda w, x: w.at_layer(jnp.int32(1)).dense(x))(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ expected[1].T, rtol=1e-5, atol=1e-5)
