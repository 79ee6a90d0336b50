"""MoE checkpoints that ship their experts quantized (Mixtral, Qwen3-MoE, DeepSeek-V3's FP8
release): the expert stacks kept packed (one IntWeight / FP8Weight per stack, not dequantized at
load), decoding greedily like HF transformers on the dequantized weights."""

import pytest
import transformers
from family_parity import TINY_SHAPES, hf_greedy_ignoring_eos, ragged_prompts, save_random_model
from test_family_deepseek import _save as save_deepseek
from test_family_deepseek import v3_like
from test_prequantized_checkpoints import SCHEMES, hf_reference

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint
from jvllm.model_loader.loader import load_model
from jvllm.quantization import FP8Weight, IntWeight

MODELS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **TINY_SHAPES, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY_SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
    ),
}
CASES = [
    ("mixtral", "gptq_int4_asym_act_order"),
    pytest.param("mixtral", "awq_group32", marks=pytest.mark.slow),
    pytest.param("mixtral", "fp8_block128", marks=pytest.mark.slow),
    ("qwen3_moe", "ct_w4a16_group32"),
    pytest.param("qwen3_moe", "ct_w8a16_channel", marks=pytest.mark.slow),
]


def _assert_decodes_like(path, hf_model, prompts, max_tokens: int = 8) -> None:
    expected = [hf_greedy_ignoring_eos(hf_model, p, max_tokens) for p in prompts]
    llm = LLM(str(path), dtype="float32", max_model_len=96, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def _assert_experts_packed(path, kind) -> None:
    _, params, _ = load_model(str(path), dtype="float32", skip_tokenizer_init=True)
    stacks = params["moe_layers" if "moe_layers" in params else "layers"]["mlp"]
    for name in ("gate_up", "down"):
        assert isinstance(stacks[name], kind) and stacks[name].experts, name


@pytest.mark.parametrize("model,scheme", CASES)
def test_quantized_experts_stay_packed_and_decode_like_hf(tmp_path, model, scheme):
    fmt, options = SCHEMES[scheme]
    save_random_model(tmp_path / "float", MODELS[model]())
    reference = quantize_checkpoint(str(tmp_path / "float"), str(tmp_path / "q"), fmt, **options)
    _assert_experts_packed(tmp_path / "q", FP8Weight if fmt == "fp8" else IntWeight)
    hf_model = hf_reference(str(tmp_path / "float"), reference, tmp_path / "ref")
    _assert_decodes_like(tmp_path / "q", hf_model, ragged_prompts(512, lengths=(3, 21)))


def test_deepseek_v3_fp8_release_format_decodes_like_hf(tmp_path):
    """V3's own FP8 layout (128 x 128 blocks, weight_scale_inv) on MLA, the dense layer, the
    shared and the routed experts: once refused, now kept in fp8."""
    save_deepseek(tmp_path / "float", v3_like())
    reference = quantize_checkpoint(str(tmp_path / "float"), str(tmp_path / "q"), "fp8")
    _assert_experts_packed(tmp_path / "q", FP8Weight)
    hf_model = hf_reference(str(tmp_path / "float"), reference, tmp_path / "ref")
    _assert_decodes_like(tmp_path / "q", hf_model, ragged_prompts(512, lengths=(5, 17)), 6)
