"""Pre-quantized checkpoints' weights over the mesh (tests/test_prequantized_checkpoints.py's
schemes): packed values, scales and zero points cut as the float weights are, decoding at T = 2
as on one device; the cuts that would split a group refused."""

import jax
import pytest
import transformers
from conftest import rewrite_gguf
from family_parity import TINY_SHAPES, ragged_prompts, save_random_model, save_tp_llama
from family_parity import TP_VOCAB as VOCAB
from gguf.constants import GGMLQuantizationType as Q
from test_gguf_families import _gguf_of
from test_prequantized_checkpoints import SCHEMES, llama

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint
from jvllm.model_loader.gguf import load_gguf
from jvllm.quantization import GGUFWeight, IntWeight, MixedGGUFWeight


def _greedy(path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=8, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "fmt,options",
    [
        ("compressed-tensors", {"scheme": "W4A16_ASYM", "group_size": 32}),
        SCHEMES["gptq_int8_per_channel"],
        SCHEMES["ct_fp8_channel"],
        SCHEMES["fp8_block128"],
        SCHEMES["awq_group32"],
    ],
)
def test_quantized_weights_under_tensor_parallelism_decode_as_on_one_device(tmp_path, fmt, options):
    """q|k|v and gate|up cut on their output rows, o and down on their input groups (a
    per-channel scale kept whole on each device)."""
    quantize_checkpoint(llama(tmp_path), str(tmp_path / "q"), fmt, **options)
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(3, 17))
    one = _greedy(tmp_path / "q", prompts)
    assert _greedy(tmp_path / "q", prompts, tensor_parallel_size=2) == one


def test_a_group_straddling_two_devices_is_refused_naming_the_sizes(tmp_path):
    """o's input (64) in 2 groups of 32 cannot be cut in 4."""
    quantize_checkpoint(llama(tmp_path), str(tmp_path / "q"), "gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="attn.o.weight: 2 groups .* tensor_parallel_size=4"):
        LLM(str(tmp_path / "q"), tensor_parallel_size=4, max_model_len=64)


def test_act_order_weights_cut_along_their_input_decode_as_on_one_device(tmp_path):
    """o and down (row-parallel) in GPTQ act-order: each device's columns in checkpoint order,
    each column's group given (g_idx), the scales whole on every device; q|k|v and gate|up
    (column-parallel) keep their sorted columns. A Mixtral's act-order experts too."""
    fmt, options = SCHEMES["gptq_int4_asym_act_order"]
    quantize_checkpoint(llama(tmp_path), str(tmp_path / "q"), fmt, **options)
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(3, 17))
    one = _greedy(tmp_path / "q", prompts)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    layers = llm.llm_engine.model_runner.params["layers"]
    down, qkv = layers["mlp"]["down"]["weight"], layers["attn"]["qkv"]["weight"]
    assert down.g_idx is not None and down.perm is None
    assert qkv.perm is not None and qkv.g_idx is None
    # down [L, 64, 128] as 64 of its 128 columns a device, its 4 groups' scales whole.
    assert [s.data.shape for s in down.scale.addressable_shards] == [(2, 64, 4)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == one
    mixtral = transformers.MixtralConfig(**TINY_SHAPES, num_local_experts=4, num_experts_per_tok=2)
    save_random_model(tmp_path / "moe", mixtral)
    quantize_checkpoint(str(tmp_path / "moe"), str(tmp_path / "moe_q"), fmt, **options)
    assert _greedy(tmp_path / "moe_q", prompts, tensor_parallel_size=2) == _greedy(
        tmp_path / "moe_q", prompts
    )


# GGUF blocks kept packed, and int8 / fp8 quantized at load, over the mesh: cut as the float
# weights are, decoding as on one device.


def _greedy_tokens(model, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    """(8 greedy tokens a prompt, the engine's params)."""
    llm = LLM(model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.model_runner.params


def _local_shapes(weight) -> dict:
    """Each field of a quantized weight -> the shapes of its slices on the devices."""
    fields = weight.fields if isinstance(weight, GGUFWeight) else vars(weight)
    return {
        k: {s.data.shape for s in x.addressable_shards}
        for k, x in fields.items()
        if isinstance(x, jax.Array)
    }


def test_the_default_model_kept_packed_decodes_over_three_devices_as_on_one():
    """SmolLM2's 9 query and 3 KV heads split over 3 devices (not 2): its Q4_1 q|k|v and
    gate|up cut on their rows shard-major, o and down on whole blocks of their inputs, the
    Q8_0 embedding (and tied head) on the vocabulary."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    one, _ = _greedy_tokens(None, prompts, quantization="gguf")
    three, params = _greedy_tokens(None, prompts, quantization="gguf", tensor_parallel_size=3)
    assert three == one
    layers = params["layers"]
    # [L, O, nb, ...]: q|k|v 3 + 1 + 1 heads of 64 a device; down 1536 / 3 inputs = 16 blocks.
    assert {shape[1] for shape in _local_shapes(layers["attn"]["qkv"]["weight"])["d"]} == {320}
    assert {shape[2] for shape in _local_shapes(layers["mlp"]["down"]["weight"])["d"]} == {16}


@pytest.mark.parametrize(("method", "dtype"), [("int8", "bfloat16"), ("fp8", "float32")])
def test_weights_quantized_at_load_decode_over_two_devices_as_on_one(tmp_path, method, dtype):
    """The float weights are placed cut, then quantized where they lie: values cut alike, a
    column-parallel weight's scales with its rows, a row-parallel one's whole on each device.
    bfloat16 int8 runs the CPU kernel on each device's slice (down's 48 inputs a device, not
    a multiple of 32, the XLA path), and fp8 the grouped kernel likewise."""
    path = save_tp_llama(tmp_path, 2, tie=True)
    prompts = ragged_prompts(VOCAB, lengths=(3, 17))
    one, _ = _greedy_tokens(path, prompts, quantization=method, dtype=dtype)
    two, params = _greedy_tokens(
        path, prompts, quantization=method, dtype=dtype, tensor_parallel_size=2
    )
    assert two == one
    attn = params["layers"]["attn"]
    # [L, O, I] and [L, O]: q|k|v 4 + 1 + 1 heads of 16 a device, o half its 128 inputs.
    assert _local_shapes(attn["qkv"]["weight"]) == {"values": {(2, 96, 64)}, "scale": {(2, 96)}}
    assert _local_shapes(attn["o"]["weight"]) == {"values": {(2, 64, 64)}, "scale": {(2, 64)}}


def test_mixtral_experts_quantized_at_load_decode_over_two_devices_as_on_one(tmp_path):
    """Each expert's gate|up cut on its output columns (scales with them), down on its inputs
    (scales whole), beside the int8 attention."""
    config = transformers.MixtralConfig(**TINY_SHAPES, num_local_experts=4, num_experts_per_tok=2)
    save_random_model(str(tmp_path), config)
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(3, 17))
    kwargs = {"quantization": "int8", "dtype": "float32"}
    one, _ = _greedy_tokens(str(tmp_path), prompts, **kwargs)
    two, params = _greedy_tokens(str(tmp_path), prompts, tensor_parallel_size=2, **kwargs)
    assert two == one
    moe = params["layers"]["mlp"]
    # [L, E, I, O] and [L, E, O]: gate|up 2 x 64 columns a device, down 64 of its 128 inputs.
    assert _local_shapes(moe["gate_up"]) == {"values": {(2, 4, 64, 128)}, "scale": {(2, 4, 128)}}
    assert _local_shapes(moe["down"]) == {"values": {(2, 4, 64, 64)}, "scale": {(2, 4, 64)}}


def _packed_tiny_gguf(tmp_path, retype=lambda name: None) -> str:
    """test_gguf_families.py's tiny Llama-converted Mistral in Q8_0 (4 query heads over 2 KV
    heads, D = 64, F = 128), the tensors `retype(name)` names requantized."""
    _, path = _gguf_of(tmp_path, "mistral")
    rewrite_gguf(path, str(tmp_path / "retyped.gguf"), retype)
    return str(tmp_path / "retyped.gguf")


def test_mixed_gguf_formats_decode_over_two_devices_as_on_one(tmp_path):
    """Layer 0's v in Q4_0 beside its q|k in Q8_0 (q|k and v each laid out by their own
    heads), layer 1's down in Q4_0 (each format's layers cut on their input blocks)."""
    retyped = {"blk.0.attn_v.weight", "blk.1.ffn_down.weight"}
    path = _packed_tiny_gguf(tmp_path, lambda name: Q.Q4_0 if name in retyped else None)
    _, params = load_gguf(path, keep_packed=True)
    for weight in (
        params["layers"]["attn"]["qkv"]["weight"],
        params["layers"]["mlp"]["down"]["weight"],
    ):
        assert isinstance(weight, MixedGGUFWeight)
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(3, 17))
    one, _ = _greedy_tokens(path, prompts, quantization="gguf")
    two, _ = _greedy_tokens(path, prompts, quantization="gguf", tensor_parallel_size=2)
    assert two == one


def test_a_gguf_block_straddling_two_devices_is_refused_naming_the_sizes(tmp_path):
    """o's 64 inputs are 2 blocks of 32: 4 devices would hold half a block each."""
    path = _packed_tiny_gguf(tmp_path)
    message = r"attn.o.weight: input size 64 in 2 GGUF blocks of 32 .* tensor_parallel_size=4"
    with pytest.raises(ValueError, match=message):
        LLM(path, quantization="gguf", tensor_parallel_size=4, max_model_len=64)


def test_fewer_kv_heads_than_devices_keep_q_k_v_packed(tmp_path):
    """One KV head over T = 2: each device holds it repeated, the packed q|k|v rows laid out as
    the float ones (and not read as floats because the mesh's rows outnumber the checkpoint's)."""
    src = save_tp_llama(tmp_path / "float", 1, tie=False)
    quantize_checkpoint(src, str(tmp_path / "q"), "gptq", bits=8, group_size=-1)
    prompts = [[5, 17, 300, 41, 9], list(range(30, 50))]
    one = _greedy(tmp_path / "q", prompts)
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    qkv = llm.llm_engine.model_runner.params["layers"]["attn"]["qkv"]["weight"]
    assert isinstance(qkv, IntWeight)
    # 8 query heads / 2 + the KV head's k and v: (4 + 1 + 1) heads of 16 rows a device.
    assert [s.data.shape[1] for s in qkv.packed.addressable_shards] == [96, 96]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == one
