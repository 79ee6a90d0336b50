"""The native CPU kernel for a few bfloat16 rows times a bfloat16 weight (layers/cpu_bf16.cc):
its products are float32 sums of the exact products, taken from the layer asked for of a stack,
the same for a row whatever shares its batch; dot_rows / dot_layer give XLA's products without
it; and a bfloat16 model's scan reads its layers' weights in place through it."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward_logits, join_native_builds

from jvllm import native
from jvllm.layers import cpu_bf16
from jvllm.layers.dot import dot_layer, dot_rows
from jvllm.model_loader.hf import load_hf_dir
from jvllm.model_loader.loader import expected_dtype

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or not native.cpu_has("avx512_bf16"),
    reason="builds the kernel with the system C++ compiler, for a CPU with AVX-512 BF16",
)
_NUM_LAYERS = 3
_KERNEL_ENV = "JVLLM_CPU_BF16_KERNEL"
_kernel = jax.jit(cpu_bf16.dense)


def _stack(num_out: int, num_in: int, seed: int = 0) -> jax.Array:
    w = np.random.default_rng(seed).standard_normal((_NUM_LAYERS, num_out, num_in))
    return jnp.asarray(w, jnp.bfloat16)  # [L, O, I]


def _rows(num_rows: int, num_in: int, seed: int = 1) -> jax.Array:
    return jnp.asarray(
        np.random.default_rng(seed).standard_normal((num_rows, num_in)), jnp.bfloat16
    )


def test_identity_rows_give_the_weights_of_the_layer_asked_for():
    w = _stack(12, 64)
    eye = jnp.eye(cpu_bf16.MAX_ROWS, 64, dtype=jnp.bfloat16)  # rows e_0 .. e_7
    assert cpu_bf16.supports(w.dtype, 64, cpu_bf16.MAX_ROWS)
    for layer in range(_NUM_LAYERS):
        got = np.asarray(_kernel(eye, w, jnp.int32(layer)))  # [8, O]
        assert np.array_equal(got.T, np.asarray(w[layer, :, : cpu_bf16.MAX_ROWS], np.float32))


@pytest.mark.parametrize("num_rows", range(1, cpu_bf16.MAX_ROWS + 1))
@pytest.mark.parametrize("shape", [(12, 96), (40, 256)])  # I past and at a multiple of 64
def test_products_are_float32_sums_and_a_rows_do_not_depend_on_its_batch(num_rows, shape):
    w, x = _stack(*shape), _rows(num_rows, shape[1])
    w64, x64 = np.asarray(w[1], np.float64), np.asarray(x, np.float64)
    got = np.asarray(_kernel(x, w, jnp.int32(1)))
    # Each product of two bfloat16 values is exact in float32; only the float32 sums round.
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(got - x64 @ w64.T) <= bound)
    for r in range(num_rows):
        alone = np.asarray(_kernel(x[r : r + 1], w, jnp.int32(1)))
        assert np.array_equal(alone[0], got[r])


@pytest.mark.parametrize(
    "x, layer, match",
    [
        (_rows(2, 64), _NUM_LAYERS, "layer in"),
        (_rows(cpu_bf16.MAX_ROWS + 1, 64), 0, "R <= 8"),
    ],
    ids=["layer_out_of_range", "too_many_rows"],
)
def test_a_call_outside_the_kernels_shapes_is_an_error_not_a_bad_read(x, layer, match):
    with pytest.raises(Exception, match=match):
        _kernel(x, _stack(8, 64), jnp.int32(layer)).block_until_ready()


@pytest.mark.parametrize("num_rows", [1, 3, cpu_bf16.MAX_ROWS, cpu_bf16.MAX_ROWS + 1])
def test_dot_rows_and_dot_layer_give_xlas_products_with_the_kernel_off(num_rows, monkeypatch):
    w, x = _stack(24, 128), _rows(num_rows, 128).astype(jnp.float32)
    layer = jnp.int32(2)
    on = [jax.jit(dot_layer)(x, w, layer), jax.jit(dot_rows)(x, w[2])]
    monkeypatch.setenv(_KERNEL_ENV, "0")
    assert not cpu_bf16.supports(w.dtype, 128, 1)
    off = [jax.jit(dot_layer)(x, w, layer), jax.jit(dot_rows)(x, w[2])]
    x64, w64 = np.asarray(x, np.float64), np.asarray(w[2], np.float64)
    bound = 2e-5 * (np.abs(x64) @ np.abs(w64).T)
    for a, b in zip(on + off, off + on, strict=True):
        assert a.shape == (num_rows, 24) and a.dtype == jnp.float32
        assert np.all(np.abs(np.asarray(a) - np.asarray(b)) <= bound)


def test_a_bfloat16_models_scan_reads_its_layers_in_place_as_accurately_as_xla(
    tiny_llama_weights_dir, monkeypatch
):
    """A decode-sized forward (6 tokens) of a random Llama: every layer's matmuls go through the
    kernel with the stacked weights and no layer's weights are copied out of their stack; its
    logits are as close to the float32 model's as XLA's path without the kernel. (No layer
    shares the LM head's shape, which goes in as [1, V, D].)"""
    token_ids = jnp.asarray([3, 17, 99, 4, 310, 7], jnp.int32)
    positions = jnp.arange(token_ids.size, dtype=jnp.int32)

    def logits(dtype: str):
        config, params = load_hf_dir(tiny_llama_weights_dir, dtype)
        run = jax.jit(lambda p, t, s: dense_forward_logits(p, t, s, config=config))
        return run, params, np.asarray(run(params, token_ids, positions))

    _, _, exact = logits("float32")
    run, params, on = logits("bfloat16")
    hlo = run.lower(params, token_ids, positions).compile().as_text()
    assert 'custom_call_target="BF16DenseStacked"' in hlo
    for w in jax.tree.leaves(params["layers"]):
        if w.ndim == 3:  # a dense layer's [L, O, I]
            assert f"bf16[1,{w.shape[1]},{w.shape[2]}]" not in hlo, "a layer was copied out"
    monkeypatch.setenv(_KERNEL_ENV, "0")
    _, _, off = logits("bfloat16")
    assert np.abs(on - exact).max() <= 1.5 * np.abs(off - exact).max()


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


def test_the_kernel_is_built_early_only_for_a_bfloat16_model(tmp_path, monkeypatch):
    monkeypatch.setenv("JVLLM_NATIVE_CACHE_DIR", str(tmp_path))
    cpu_bf16.build_early("float32")
    join_native_builds()
    assert list(tmp_path.iterdir()) == []
    cpu_bf16.build_early("bfloat16")
    join_native_builds()
    assert [p.name.startswith("cpu_bf16-") for p in tmp_path.glob("*.so")] == [True]
