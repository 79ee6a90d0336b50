"""The native CPU kernel for rows times a bfloat16 or float32 weight (native/cpu_dense.cc): its
products are float32 sums, taken from the layer asked for of a stack, the same for a row whatever
shares its batch (streamed up to STREAM_ROWS rows, in tiles past it); dot_rows / dot_layer give
XLA's products without it; and a model's scan reads its layers' weights in place through it."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward_logits, join_native_builds

from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.loader import expected_dtype
from jvllm.quantization import cpu_dense
from jvllm.quantization.dot import dot_layer, dot_rows

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernel with the system C++ compiler"
)
_DTYPES = ["bfloat16", "float32"]
_NUM_LAYERS = 3
_KERNEL_ENV = "JVLLM_CPU_DENSE_KERNEL"
_kernel = jax.jit(cpu_dense.dense)


def _stack(num_out: int, num_in: int, dtype: str, seed: int = 0) -> jax.Array:
    w = np.random.default_rng(seed).standard_normal((_NUM_LAYERS, num_out, num_in))
    return jnp.asarray(w, dtype)  # [L, O, I]


def _rows(num_rows: int, num_in: int, dtype: str, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((num_rows, num_in)), dtype)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("num_rows", [cpu_dense.STREAM_ROWS, 13])  # streamed; tiles and a rest
def test_identity_rows_give_the_weights_of_the_layer_asked_for(dtype, num_rows):
    w = _stack(14, 64, dtype)
    eye = jnp.eye(num_rows, 64, dtype=dtype)  # rows e_0 .. e_{R-1}
    assert cpu_dense.supports(w.dtype, 64, num_rows, in_place=True)
    for layer in range(_NUM_LAYERS):
        got = np.asarray(_kernel(eye, w, jnp.int32(layer)))  # [R, O]
        assert np.array_equal(got.T, np.asarray(w[layer, :, :num_rows], np.float32))


# Streamed (1 to 8), then tiles of 2 rows x 4 outputs with a row and outputs left over.
_NUM_ROWS = [*range(1, cpu_dense.STREAM_ROWS + 1), 9, 16, 37, cpu_dense.MAX_ROWS]


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("num_rows", _NUM_ROWS)
@pytest.mark.parametrize("shape", [(13, 96), (40, 256)])  # I past and at a multiple of 64
def test_products_are_float32_sums_and_a_rows_do_not_depend_on_its_batch(dtype, num_rows, shape):
    w, x = _stack(*shape, dtype), _rows(num_rows, shape[1], dtype)
    w64, x64 = np.asarray(w[1], np.float64), np.asarray(x, np.float64)
    got = np.asarray(_kernel(x, w, jnp.int32(1)))
    # A float32 sum of I products, each exact (bfloat16) or rounded once with its addition
    # (float32's fused multiply-add), is off by at most about I float32 roundings.
    bound = shape[1] * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(got - x64 @ w64.T) <= bound)
    # A few rows alone, and the last three together: streamed calls of 1 and 3 rows.
    for r in sorted({0, num_rows // 2, num_rows - 1}):
        alone = np.asarray(_kernel(x[r : r + 1], w, jnp.int32(1)))
        assert np.array_equal(alone[0], got[r])
    if num_rows > 3:  # else the same call as `got`
        tail = np.asarray(_kernel(x[-3:], w, jnp.int32(1)))
        assert np.array_equal(tail, got[-3:])


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize(
    "num_rows, layer, match",
    [(2, _NUM_LAYERS, "layer in"), (cpu_dense.MAX_ROWS + 1, 0, "R <= 64")],
    ids=["layer_out_of_range", "too_many_rows"],
)
def test_a_call_outside_the_kernels_shapes_is_an_error_not_a_bad_read(
    dtype, num_rows, layer, match
):
    with pytest.raises(Exception, match=match):
        _kernel(
            _rows(num_rows, 64, dtype), _stack(8, 64, dtype), jnp.int32(layer)
        ).block_until_ready()


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, cpu_dense.STREAM_ROWS + 1, cpu_dense.MAX_ROWS + 1])
def test_dot_rows_and_dot_layer_give_xlas_products_with_the_kernel_off(
    dtype, num_rows, monkeypatch
):
    w, x = _stack(24, 128, dtype), _rows(num_rows, 128, "float32")
    layer = jnp.int32(2)
    on = [jax.jit(dot_layer)(x, w, layer), jax.jit(dot_rows)(x, w[2])]
    monkeypatch.setenv(_KERNEL_ENV, "0")
    assert not cpu_dense.supports(w.dtype, 128, 1)
    off = [jax.jit(dot_layer)(x, w, layer), jax.jit(dot_rows)(x, w[2])]
    x64, w64 = np.asarray(x.astype(dtype), np.float64), np.asarray(w[2], np.float64)
    bound = 2e-5 * (np.abs(x64) @ np.abs(w64).T)
    for a, b in zip(on + off, off + on, strict=True):
        assert a.shape == (num_rows, 24) and a.dtype == jnp.float32
        assert np.all(np.abs(np.asarray(a) - np.asarray(b)) <= bound)


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("num_tokens", [6, 40])  # streamed, tiles
def test_a_models_scan_reads_its_layers_in_place_as_accurately_as_xla(
    dtype, num_tokens, tiny_llama_weights_dir, monkeypatch
):
    """A decode-sized forward of a random Llama: every layer's matmuls go through the kernel
    with the stacked weights and no layer's weights are copied out of their stack; its logits
    are as close to the float32 model's as XLA's path without the kernel (in float32, as close
    as two orders of float32 sums). (No layer shares the LM head's shape.)"""
    token_ids = jnp.asarray(np.random.default_rng(0).integers(3, 400, num_tokens), jnp.int32)
    positions = jnp.arange(token_ids.size, dtype=jnp.int32)

    def logits(dtype: str):
        config, params = load_hf_dir(tiny_llama_weights_dir, dtype)
        run = jax.jit(lambda p, t, s: dense_forward_logits(p, t, s, config=config))
        return run, params, np.asarray(run(params, token_ids, positions))

    run, params, on = logits(dtype)
    hlo = run.lower(params, token_ids, positions).compile().as_text()
    target, short = ("BF16", "bf16") if dtype == "bfloat16" else ("F32", "f32")
    assert f'custom_call_target="{target}DenseStacked"' in hlo
    for w in jax.tree.leaves(params["layers"]):
        if w.ndim == 3:  # a dense layer's [L, O, I]
            assert f"{short}[1,{w.shape[1]},{w.shape[2]}]" not in hlo, "a layer was copied out"
    monkeypatch.setenv(_KERNEL_ENV, "0")
    _, _, off = logits(dtype)
    if dtype == "bfloat16":
        _, _, exact = logits("float32")
        assert np.abs(on - exact).max() <= 1.5 * np.abs(off - exact).max()
    else:
        assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()


@pytest.mark.parametrize(
    "checkpoint_dtype, dtype, expected",
    [
        ("bfloat16", "auto", "bfloat16"),
        ("float16", "auto", "float32"),  # as load_model runs a float16 checkpoint
        ("float32", "bfloat16", "bfloat16"),
    ],
)
def test_the_engine_knows_a_models_dtype_before_loading_it(
    tmp_path, checkpoint_dtype, dtype, expected
):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": checkpoint_dtype}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # load_model warns of a float16 checkpoint, not this
        assert expected_dtype(str(tmp_path), dtype) == expected
    assert expected_dtype(None, dtype) == ("float32" if dtype == "auto" else dtype)  # a GGUF


def test_the_kernel_is_built_early_only_for_a_dtype_it_has(tmp_path, monkeypatch):
    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path))
    cpu_dense.build_early("float16")
    join_native_builds()
    assert list(tmp_path.iterdir()) == []
    cpu_dense.build_early("float32")
    join_native_builds()
    assert [p.name.startswith("cpu_dense-") for p in tmp_path.glob("*.so")] == [True]
