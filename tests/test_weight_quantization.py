"""int8 and fp8 weights made at load (quantization="int8" | "fp8"): per-channel scales that
bound each weight's error, a matmul that matches the float one (on CPU fp8's through the grouped
kernel), and on the default model greedy text and perplexity close to bfloat16's."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import LLM
from jvllm.benchmarks import quality
from jvllm.engine.arg_utils import EngineArgs
from jvllm.entrypoints.cli import build_parser
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.model_loader.loader import load_model
from jvllm.quantization import ChannelWeight, is_quantized
from jvllm.quantization.channel_weight import fp8_matmul, quantize_channels
from jvllm.quantization.rows import quantize_rows
from tests.conftest import SMOLLM2_ENGINE_KWARGS

# The shared test settings, with room for the 572-token perplexity text.
_ENGINE_KWARGS = {**SMOLLM2_ENGINE_KWARGS, "max_model_len": 1024, "dtype": "bfloat16"}
# The closest a quantized model's perplexity must stay to bfloat16's (issue 22).
_MAX_PERPLEXITY_RATIO = {"int8": 1.02, "fp8": 1.04}
# Of the 16 prompts, how many must keep all of their first 16 greedy tokens equal to
# bfloat16's (BENCHMARKS.md, "Quantized weights", has the counts each method gets).
_MIN_ALL_EQUAL = {"int8": 8, "fp8": 4}


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_each_weight_is_within_half_a_step_of_its_format(method):
    w = jax.random.normal(jax.random.key(0), (2, 24, 40)) * jnp.arange(1, 25)[:, None]
    w = w.at[1, 3].set(0.0)  # an all-zero row keeps a usable scale
    q = quantize_channels(w, method, "float32")
    assert q.values.shape == w.shape and q.scale.shape == (2, 24)
    restored = q.values.astype(jnp.float32) * q.scale[..., None]
    if method == "int8":  # half a step of 1/127 of the row's largest |w|
        bound = jnp.abs(w).max(-1, keepdims=True) / 127 / 2
    else:  # e4m3: half its 3-bit mantissa's step, relative; subnormals step 2**-9 of the scale
        bound = jnp.maximum(jnp.abs(w) / 16, q.scale[..., None] * 2.0**-10)
    assert jnp.all(jnp.abs(restored - w) <= bound * 1.0001 + 1e-12)
    assert jnp.all(restored[1, 3] == 0)


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("num_rows", [1, 5])
def test_quantized_dense_equals_the_float_product_of_its_values(method, num_rows):
    key_w, key_x = jax.random.split(jax.random.key(1))
    q = quantize_channels(jax.random.normal(key_w, (48, 64)), method, "float32")
    x = jax.random.normal(key_x, (num_rows, 64))
    want = x @ (q.values.astype(jnp.float32) * q.scale[:, None]).T
    np.testing.assert_allclose(jax.jit(lambda q, x: q.dense(x))(q, x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds the CPU kernel with g++")
@pytest.mark.parametrize("num_rows", [1, 7, 33])  # the kernel's products; its layer, past 32
def test_on_cpu_fp8_values_meet_rows_in_the_grouped_kernel_as_in_xla(num_rows, monkeypatch):
    """ChannelWeight.dense at a scanned layer, the grouped kernel on and off: its values times
    a scale of one are the values themselves, scaled after the products as XLA's path does."""
    w = jax.random.normal(jax.random.key(0), (3, 24, 128))
    weight = quantize_channels(w, "fp8", "bfloat16")
    x = jax.random.normal(jax.random.key(1), (num_rows, 128)).astype(jnp.bfloat16)
    dense = jax.jit(lambda w, x: w.at_layer(jnp.int32(2)).dense(x))
    assert "IntGroupDense" in dense.lower(weight, x[:1]).compile().as_text()
    on = np.asarray(dense(weight, x))
    monkeypatch.setenv("JVLLM_CPU_INT_GROUP_KERNEL", "0")
    off = np.asarray(jax.jit(lambda w, x: w.at_layer(jnp.int32(2)).dense(x))(weight, x))
    if num_rows > 32:  # XLA's matmul of the same values either way
        np.testing.assert_array_equal(on, off)
    w64 = np.asarray(weight.values[2], np.float64) * np.asarray(weight.scale[2])[:, None]
    bound = 1e-6 * (np.abs(np.asarray(x, np.float64)) @ np.abs(w64).T)
    assert np.all(np.abs(on - off) <= bound)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantizing_at_load_rounds_as_the_row_quantization(method):
    # quantize_channels runs jitted (its float32 intermediates fused away): the same values.
    w = jax.random.normal(jax.random.key(4), (2, 40, 72)).astype(jnp.bfloat16)
    q = quantize_channels(w, method, "bfloat16")
    values, scale = quantize_rows(w, q.values.dtype, jnp.float32)
    np.testing.assert_array_equal(q.values.astype(jnp.float32), values.astype(jnp.float32))
    np.testing.assert_array_equal(q.scale, scale)


def test_engine_args_refuse_gguf_with_dummy_weights_before_anything_loads():
    with pytest.raises(ValueError, match="use one or the other"):
        EngineArgs(quantization="gguf", load_format="dummy")


def test_engine_args_take_int8_and_fp8_under_tensor_parallelism():
    for method in ("int8", "fp8"):
        assert EngineArgs(quantization=method, tensor_parallel_size=2).tensor_parallel_size == 2


def test_fp8_matmul_with_fp8_activations_stays_close_to_the_float_product():
    key_w, key_x = jax.random.split(jax.random.key(2))
    q = quantize_channels(jax.random.normal(key_w, (48, 256)), "fp8", "bfloat16")
    x = jax.random.normal(key_x, (3, 256))
    want = x @ (q.values.astype(jnp.float32) * q.scale[:, None]).T
    got = jax.jit(fp8_matmul)(x, q.values, q.scale)
    # Rounding x to e4m3 (3 mantissa bits) costs a few percent of a 256-term sum's scale.
    assert float(jnp.abs(got - want).max()) < 0.1 * float(jnp.abs(want).max())


def test_only_the_layers_matmul_weights_are_quantized():
    _, params, _ = load_model(None, dtype="bfloat16", quantization="int8")
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
    quantized = {jax.tree_util.keystr(p) for p, x in leaves if isinstance(x, ChannelWeight)}
    assert quantized == {
        "['layers']['attn']['qkv']['weight']",
        "['layers']['attn']['o']['weight']",
        "['layers']['mlp']['gate_up']['weight']",
        "['layers']['mlp']['down']['weight']",
    }
    assert params["embed"]["embedding"].dtype == jnp.bfloat16  # also the tied LM head


@pytest.fixture(scope="module")
def bfloat16_quality(smollm2_bfloat16_llm) -> tuple[float, list[list[int]]]:
    llm = smollm2_bfloat16_llm
    return quality.perplexity(llm), quality.greedy_token_ids(llm)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_default_model_stays_close_to_bfloat16(method, bfloat16_quality):
    reference_perplexity, reference_tokens = bfloat16_quality
    llm = LLM(quantization=method, **_ENGINE_KWARGS)
    ratio = quality.perplexity(llm) / reference_perplexity
    agreement = quality.greedy_agreement(quality.greedy_token_ids(llm), reference_tokens)
    assert ratio < _MAX_PERPLEXITY_RATIO[method]
    assert agreement.num_all_equal >= _MIN_ALL_EQUAL[method], agreement


def test_serve_takes_the_quantization_flag():
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert engine_kwargs(args)["quantization"] == "int8"
    args = build_parser().parse_args(["serve", "--quantization", "gptq_marlin"])
    assert engine_kwargs(args)["quantization"] == "gptq_marlin"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "bitsandbytes"])
