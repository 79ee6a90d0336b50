"""Our GGUF reading (gguf_file.py, dequantize.py) against the gguf package's, bit for bit."""

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from jvllm.model_loader import default_model
from jvllm.model_loader.dequantize import SUPPORTED_QTYPES, dequantize
from jvllm.model_loader.gguf_file import read_gguf

# 3 rows of 4200 blocks: more than one of dequantize's chunks, and a partial one.
SHAPE = (3, 32 * 4200)


def _gguf_values(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(gguf_dequantize(data, qtype), np.float32).reshape(shape)


def _random_bytes(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Any bytes are valid blocks: scales and values come out random, NaN and inf included."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    num_bytes = int(np.prod(shape)) // block_size * block_bytes
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


# The types dequantize does itself, and one it leaves to gguf.
@pytest.mark.parametrize("qtype", [*SUPPORTED_QTYPES, Q.Q4_K], ids=lambda q: q.name)
def test_dequantize_random_blocks_is_bit_identical_to_gguf(qtype):
    data = _random_bytes(qtype, SHAPE)
    strided_out = np.zeros(SHAPE[::-1], np.float32).T  # e.g. a permuted view of a bigger buffer
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and the like, in both
        expected = _gguf_values(data, qtype, SHAPE).tobytes()
        assert dequantize(data, qtype, SHAPE).tobytes() == expected
        dequantize(data, qtype, SHAPE, strided_out)
    assert strided_out.tobytes() == expected


def test_dequantize_rejects_an_out_of_the_wrong_shape():
    data = _random_bytes(Q.Q8_0, SHAPE)
    with pytest.raises(ValueError, match="expected float32"):
        dequantize(data, Q.Q8_0, SHAPE, np.empty(SHAPE[::-1], np.float32))


def test_dequantize_default_model_tensors_is_bit_identical_to_gguf():
    try:
        path = default_model.resolve_default_model()
    except ImportError as e:
        pytest.skip(str(e))
    tensors = read_gguf(path).tensors.values()
    assert {t.qtype for t in tensors} == {Q.Q4_1, Q.Q8_0, Q.F32}
    for t in tensors:
        expected = _gguf_values(t.data, t.qtype, t.shape)
        assert dequantize(t.data, t.qtype, t.shape).tobytes() == expected.tobytes(), t.name


def test_read_gguf_gives_gguf_readers_metadata_and_tensors(tmp_path):
    path = str(tmp_path / "model.gguf")
    writer = GGUFWriter(path, arch="llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -3)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -30000)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -2_000_000_000)
    writer.add_uint64("u64", 2**63 + 5)
    writer.add_int64("i64", -(2**62))
    writer.add_float32("f32", 1e-5)
    writer.add_float64("f64", 0.1)
    writer.add_bool("flag", True)
    writer.add_string("name", "ünïcödé 🙂")
    writer.add_array("tokens", ["a", "Ġthe", "<|im_end|>", "日本"])
    writer.add_array("token_types", [1, 3, 3, 1])
    writer.add_array("scores", [0.5, -1.25])
    writer.add_key_value("offsets", [2**40, 3], GGUFValueType.ARRAY, GGUFValueType.UINT64)
    rng = np.random.default_rng(0)
    expected_shapes = {}
    for i, qtype in enumerate(SUPPORTED_QTYPES):
        values = rng.standard_normal((2 + i, 64)).astype(np.float32)
        writer.add_tensor(f"t{i}", quantize(values, qtype), raw_dtype=qtype)
        expected_shapes[f"t{i}"] = values.shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, reference = read_gguf(path), GGUFReader(path)
    expected_metadata = {
        name: field.contents()
        for name, field in reference.fields.items()
        if not name.startswith("GGUF.")
    }
    assert ours.metadata == expected_metadata
    assert ours.metadata["u64"] == 2**63 + 5 and ours.metadata["offsets"] == [2**40, 3]
    assert ours.metadata["tokens"][3] == "日本"
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        got = ours.tensors[t.name]
        assert (got.qtype, got.shape) == (t.tensor_type, expected_shapes[t.name])
        assert got.data.tobytes() == t.data.tobytes()
