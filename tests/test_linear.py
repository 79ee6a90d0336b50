"""dense: the one projection every layer and the LM head go through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.layers.linear import dense


def _reference(x: np.ndarray, w: jax.Array) -> np.ndarray:
    """x @ w.T in float64 after rounding x to w's dtype, as dense promises."""
    x = np.asarray(jnp.asarray(x).astype(w.dtype).astype(jnp.float64))
    return x @ np.asarray(w.astype(jnp.float64)).T


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_matches_float64_product(rows, dtype):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((40, 96)), dtype)
    out = jax.jit(dense)(x, w)
    assert out.shape == (rows, 40) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(x, w), rtol=1e-5, atol=1e-5)


def test_one_bfloat16_row_does_not_convert_the_weight_whole(monkeypatch):
    """Without the CPU dense kernel (quantization/cpu_dense.py) the 1-row bfloat16 case must not
    turn into a float32 copy of w and a dot (6x slower on CPU): the conversion is fused into the
    reduction, so no float32 [O, I] buffer appears."""
    monkeypatch.setenv("JVLLM_CPU_DENSE_KERNEL", "0")
    w = jnp.ones((40, 96), jnp.bfloat16)
    hlo = jax.jit(dense).lower(jnp.ones((1, 96)), w).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    assert "f32[40,96]" not in entry
