"""Pre-quantized checkpoints' weights over the mesh (tests/test_prequantized_checkpoints.py's
schemes): packed values, scales and zero points cut as the float weights are, decoding at T = 2
as on one device; the cuts that would split a group refused."""

import pytest
from family_parity import TINY_SHAPES, ragged_prompts
from quantized_checkpoints import quantize_checkpoint
from test_prequantized_checkpoints import SCHEMES, llama

from jvllm import LLM, SamplingParams


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


def test_act_order_under_row_parallel_cut_is_refused(tmp_path):
    fmt, options = SCHEMES["gptq_int4_asym_act_order"]
    quantize_checkpoint(llama(tmp_path), str(tmp_path / "q"), fmt, **options)
    with pytest.raises(ValueError, match="act-order"):
        LLM(str(tmp_path / "q"), tensor_parallel_size=2, max_model_len=64)
