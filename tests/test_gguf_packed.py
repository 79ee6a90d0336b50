"""GGUF weights kept packed (quantization="gguf"): the in-step dequantization equals the gguf
package's bit for bit, and the default model from its packed GGUF generates what the float32
path generates."""

import jax
import numpy as np
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS, random_gguf_blocks
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from jvllm import LLM, SamplingParams
from jvllm.model_loader.default_model import resolve_default_model
from jvllm.model_loader.gguf import load_gguf
from jvllm.model_loader.gguf_file import read_gguf
from jvllm.model_loader.loader import load_model
from jvllm.quantization import GGUFWeight, is_quantized
from jvllm.quantization.gguf_blocks import PACKED_QTYPES, split_fields

_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors:",
]


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", PACKED_QTYPES, ids=lambda q: q.name)
def test_in_step_dequantization_equals_gguf_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = random_gguf_blocks(qtype, (6, 8), rng)  # [O, nb]
    fields = {k: jax.numpy.asarray(v) for k, v in split_fields(blocks, qtype).items()}
    weight = GGUFWeight(fields, int(qtype), "float32")
    got = jax.jit(lambda w: w.dequantize())(weight)
    want = gguf_dequantize(blocks.view(np.uint8).reshape(6, -1), qtype)
    assert weight.shape == want.shape
    assert _same_bits(got, want)
    rows = jax.numpy.array([5, 0, 5], jax.numpy.int32)
    assert _same_bits(jax.jit(lambda w, r: w.dequantize(r))(weight, rows), want[[5, 0, 5]])


def test_default_model_packed_tensors_equal_the_float_path():
    path = resolve_default_model()
    _, packed = load_gguf(path, keep_packed=True)
    _, floats = load_gguf(path)
    packed_leaves = jax.tree.leaves(packed, is_leaf=is_quantized)
    float_leaves = jax.tree.leaves(floats)
    assert len(packed_leaves) == len(float_leaves)
    num_packed = 0
    for p, f in zip(packed_leaves, float_leaves):
        if isinstance(p, GGUFWeight):
            num_packed += 1
            assert _same_bits(jax.jit(lambda w: w.dequantize())(p), f)
        else:
            assert _same_bits(p, f)
    assert num_packed == 5  # embedding (Q8_0), qkv, o, gate_up, down (Q4_1)


def test_packed_weights_stay_within_the_files_tensor_bytes():
    path = resolve_default_model()
    file_bytes = sum(t.data.nbytes for t in read_gguf(path).tensors.values())
    config, params, _ = load_model(None, quantization="gguf")
    resident = sum(x.nbytes for x in jax.tree.leaves(params))
    assert config.dtype == "float32"
    assert resident <= 1.2 * file_bytes, (resident, file_bytes)


def test_a_gguf_file_stays_packed_unless_a_float_dtype_is_asked_for():
    path = resolve_default_model()
    _, packed, _ = load_model(path)
    assert isinstance(packed["layers"]["mlp"]["down"]["weight"], GGUFWeight)
    _, floats, _ = load_model(path, dtype="bfloat16")
    assert not any(is_quantized(x) for x in jax.tree.leaves(floats, is_leaf=is_quantized))


def test_greedy_outputs_from_the_packed_gguf_equal_the_float32_path(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    packed = LLM(quantization="gguf", **SMOLLM2_ENGINE_KWARGS)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(_PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in packed.generate(_PROMPTS, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization": "awq"}, "allowed: ('gguf', 'int8', 'fp8')"),
        ({"quantization": "gguf", "model": "/nonexistent/model-dir"}, "needs a .gguf file"),
    ],
)
def test_unsupported_quantization_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(kwargs.pop("model", None), **kwargs)


def test_a_block_format_not_kept_packed_is_a_clear_error(tmp_path):
    path = str(tmp_path / "q3k.gguf")
    writer = GGUFWriter(path, arch="llama")
    for key, value in {
        "block_count": 1,
        "embedding_length": 256,
        "feed_forward_length": 256,
        "attention.head_count": 4,
        "context_length": 64,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.vocab_size", 8)
    q3_k = np.zeros((256, 110), np.uint8)  # one 110-byte Q3_K block per row of 256 values
    writer.add_tensor("blk.0.attn_q.weight", q3_k, raw_dtype=Q.Q3_K)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' is Q3_K.*supported: \['Q8_0'"):
        load_model(path)
