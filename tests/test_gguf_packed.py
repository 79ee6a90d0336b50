"""GGUF weights kept packed (quantization="gguf"): the in-step dequantization equals the gguf
package's bit for bit, and the default model from its packed GGUF generates what the float32
path generates."""

import jax
import numpy as np
import pytest
from conftest import SMOLLM2_ENGINE_KWARGS, random_gguf_blocks, rewrite_gguf
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from jvllm import LLM, SamplingParams
from jvllm.model_loader.default_model import resolve_default_model
from jvllm.model_loader.gguf import load_gguf
from jvllm.model_loader.gguf_file import read_gguf
from jvllm.model_loader.loader import load_model
from jvllm.quantization import GGUFWeight, MixedGGUFWeight, is_quantized
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
        ({"quantization": "bitsandbytes"}, "allowed: ('gguf', 'int8', 'fp8', "),
        ({"quantization": "awq"}, "names a pre-quantized checkpoint format"),
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


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    """The default model with formats mixed as llama.cpp's Q4_K_M mixes them: attn_v differs
    from q and k in most layers (Q8_0, Q5_1 or the file's Q4_1 in turn) and ffn_down is Q5_0 in
    every fourth layer."""

    def retype(name: str):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        if name.endswith("attn_v.weight"):
            return (Q.Q8_0, Q.Q5_1, None)[layer % 3]
        if name.endswith("ffn_down.weight") and layer % 4 == 0:
            return Q.Q5_0
        return None

    path = str(tmp_path_factory.mktemp("mixed") / "mixed.gguf")
    rewrite_gguf(resolve_default_model(), path, retype)
    return path


def test_formats_mixed_between_layers_and_pieces_stay_packed_and_equal_the_float_path(
    mixed_gguf,
):
    _, packed = load_gguf(mixed_gguf, keep_packed=True)
    _, floats = load_gguf(mixed_gguf)
    attn, mlp = packed["layers"]["attn"], packed["layers"]["mlp"]
    qkv, down = attn["qkv"]["weight"], mlp["down"]["weight"]
    assert isinstance(qkv, MixedGGUFWeight) and isinstance(down, MixedGGUFWeight)
    assert [len(groups) for groups in qkv.pieces] == [1, 3]  # q|k one format, v three
    assert [len(groups) for groups in down.pieces] == [2]
    assert qkv.shape == floats["layers"]["attn"]["qkv"]["weight"].shape
    for weight, want in (
        (qkv, floats["layers"]["attn"]["qkv"]["weight"]),
        (down, floats["layers"]["mlp"]["down"]["weight"]),
    ):
        assert _same_bits(jax.jit(lambda w: w.dequantize())(weight), want)
    file_bytes = sum(t.data.nbytes for t in read_gguf(mixed_gguf).tensors.values())
    resident = sum(x.nbytes for x in jax.tree.leaves(packed))
    assert resident <= 1.2 * file_bytes, (resident, file_bytes)


def test_greedy_outputs_from_a_mixed_gguf_equal_its_float32_path(mixed_gguf):
    params = SamplingParams(temperature=0, max_tokens=24)
    kwargs = {"max_model_len": 512, "max_num_seqs": 4}
    packed = LLM(mixed_gguf, **kwargs)
    got = [o.outputs[0].token_ids for o in packed.generate(_PROMPTS, params, use_tqdm=False)]
    del packed
    floats = LLM(mixed_gguf, dtype="float32", **kwargs)
    want = [o.outputs[0].token_ids for o in floats.generate(_PROMPTS, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_a_mixed_weights_products_at_each_layer_are_its_formats(kernel, monkeypatch):
    """A random weight of 4 layers whose first piece is Q4_K in every layer and whose second
    is Q6_K or Q5_K by layer: its products inside a layer scan, and those of each layer's own
    weight (the layers split on a GPU), equal the dequantized layers', kernel on and off."""
    monkeypatch.setenv("JVLLM_CPU_GGUF_KERNEL", kernel)
    rng = np.random.default_rng(0)

    layers_of = (((0, 1, 2, 3),), ((0, 2, 3), (1,)))  # [piece][format]
    formats = ((Q.Q4_K,), (Q.Q6_K, Q.Q5_K))
    rows, num_blocks = (8, 5), 2
    values = np.zeros((4, sum(rows), 512))  # [L, O, I], as gguf dequantizes each layer
    pieces = []
    for p, (groups, qtypes) in enumerate(zip(layers_of, formats)):
        weights = []
        for layers, qtype in zip(groups, qtypes):
            blocks = random_gguf_blocks(qtype, (len(layers) * rows[p], num_blocks), rng)
            for i, layer in enumerate(layers):
                raw = blocks[i * rows[p] : (i + 1) * rows[p]].view(np.uint8)
                values[layer, sum(rows[:p]) : sum(rows[: p + 1])] = gguf_dequantize(raw, qtype)
            fields = split_fields(blocks.reshape(len(layers), rows[p], num_blocks), qtype)
            fields = {k: jax.numpy.asarray(v) for k, v in fields.items()}
            weights.append(GGUFWeight(fields, int(qtype), "float32"))
        pieces.append(tuple(weights))
    weight = MixedGGUFWeight(tuple(pieces), layers_of)
    assert weight.shape == (4, 13, 512)
    assert _same_bits(jax.jit(lambda w: w.dequantize())(weight), values)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    want = np.einsum("ri,loi->lro", x, values)
    bound = 1e-5 * np.einsum("ri,loi->lro", np.abs(x), np.abs(values))  # float32 sums' error

    def scan(w, x):
        layers = jax.numpy.arange(4)
        return jax.lax.scan(lambda _, layer: (None, w.at_layer(layer).dense(x)), None, layers)[1]

    assert np.all(np.abs(jax.jit(scan)(weight, x) - want) <= bound)
    for layer, own in enumerate(weight.layer_weights()):
        got = jax.jit(lambda w: w.dense(x))(own)
        assert np.all(np.abs(got - want[layer]) <= bound[layer])
