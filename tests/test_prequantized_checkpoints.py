"""Pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ, FP8 blocks) as the tools write them
(jvllm/benchmarks/quantized_checkpoints.py): kept packed on the device, dequantized bit for bit as the
format's own code does, and decoding greedily like HF transformers running the dequantized
weights; their config errors named before anything loads."""

import json

import jax
import numpy as np
import pytest
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_matches_hf,
    hf_greedy_ignoring_eos,
    ragged_prompts,
    save_random_model,
)

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint, save_reference
from jvllm.model_loader.loader import is_prequantized, load_model
from jvllm.model_loader.quant_config import checkpoint_quantization
from jvllm.quantization import FP8Weight, IntWeight, is_quantized

# (format, options): each scheme a user downloads, on the tiny models' shapes (I of 64 / 128).
SCHEMES = {
    "ct_w4a16_group32": ("compressed-tensors", {"scheme": "W4A16", "group_size": 32}),
    "ct_w4a16_asym_group64": (
        "compressed-tensors",
        {"scheme": "W4A16_ASYM", "group_size": 64},
    ),
    # 48 divides neither 64 nor 128: the last group is shorter, as SmolLM2's 576 in 128s
    # (GPTQ writes such groups; compressed-tensors refuses them).
    "gptq_int4_group48_not_dividing": ("gptq", {"bits": 4, "group_size": 48, "sym": False}),
    "ct_w8a16_channel": ("compressed-tensors", {"scheme": "W8A16", "strategy": "channel"}),
    "ct_w8a16_group32": ("compressed-tensors", {"scheme": "W8A16", "group_size": 32}),
    "ct_w8a8_int8_channel": ("compressed-tensors", {"scheme": "W8A8"}),
    "ct_fp8_tensor": ("compressed-tensors", {"scheme": "FP8"}),
    "ct_fp8_channel": ("compressed-tensors", {"scheme": "FP8_DYNAMIC"}),
    "ct_fp8_block": ("compressed-tensors", {"scheme": "FP8_BLOCK"}),
    "gptq_int4_group32": ("gptq", {"bits": 4, "group_size": 32}),
    "gptq_int4_asym_act_order": (
        "gptq",
        {"bits": 4, "group_size": 32, "sym": False, "desc_act": True},
    ),
    "gptq_int8_per_channel": ("gptq", {"bits": 8, "group_size": -1}),
    "awq_group32": ("awq", {"group_size": 32}),
    "fp8_block128": ("fp8", {}),
}


def llama(tmp_path):
    config = transformers.LlamaConfig(**TINY_SHAPES, tie_word_embeddings=False)
    save_random_model(tmp_path / "float", config)
    return str(tmp_path / "float")


def _dequantized_params(params) -> dict[str, np.ndarray]:
    """{path: f32 values} of each quantized param as loaded, columns in checkpoint order."""
    out = {}
    for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]:
        if not isinstance(w, IntWeight | FP8Weight):
            continue
        # Inside jit, as the step computes them (where XLA may fuse away a rounding).
        values = np.asarray(jax.jit(lambda w: w.dequantize())(w), np.float32)  # [L, O, I]
        if getattr(w, "perm", None) is not None:
            inverse = np.argsort(np.asarray(w.perm), axis=-1)  # [L, I]
            values = np.take_along_axis(values, inverse[:, None, :], axis=-1)
        out[".".join(str(getattr(k, "key", k)) for k in path)] = values
    return out


@pytest.mark.parametrize("name", list(SCHEMES))
def test_checkpoint_stays_packed_and_dequantizes_bit_for_bit(tmp_path, name):
    fmt, options = SCHEMES[name]
    src = llama(tmp_path)
    reference = quantize_checkpoint(src, str(tmp_path / "q"), fmt, **options)
    config, params, _ = load_model(str(tmp_path / "q"), dtype="float32")
    loaded = _dequantized_params(params)
    # Every projection is kept quantized: q|k|v and gate|up fused, o and down.
    assert set(loaded) == {
        "layers.attn.qkv.weight",
        "layers.attn.o.weight",
        "layers.mlp.gate_up.weight",
        "layers.mlp.down.weight",
    }
    pieces = {
        "layers.attn.qkv.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "layers.attn.o.weight": ("self_attn.o_proj",),
        "layers.mlp.gate_up.weight": ("mlp.gate_proj", "mlp.up_proj"),
        "layers.mlp.down.weight": ("mlp.down_proj",),
    }
    for path, modules in pieces.items():
        for layer in range(config.num_layers):
            expected = np.concatenate(
                [reference[f"model.layers.{layer}.{m}.weight"].numpy() for m in modules]
            )
            np.testing.assert_array_equal(loaded[path][layer], expected, err_msg=path)
    assert len(reference) == 7 * config.num_layers  # q, k, v, o, gate, up, down


def hf_reference(src: str, reference: dict, path) -> transformers.PreTrainedModel:
    """HF transformers' float32 model of `src` with its linear weights `reference`'s."""
    save_reference(src, str(path), reference)
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


# The schemes whose greedy parity runs in the default job: one of each format and of each
# kernel path (int4 with zero points, act-order, int8 channels, FP8 blocks); the other schemes'
# (their dequantization checked bit for bit above) in the slow job.
_DEFAULT_JOB = {
    "ct_w4a16_asym_group64",
    "ct_fp8_channel",
    "gptq_int4_asym_act_order",
    "gptq_int8_per_channel",
    "awq_group32",
    "fp8_block128",
}


@pytest.mark.parametrize(
    "name",
    [n if n in _DEFAULT_JOB else pytest.param(n, marks=pytest.mark.slow) for n in SCHEMES],
)
def test_checkpoint_decodes_like_hf_on_its_dequantized_weights(tmp_path, name):
    """One batch of ragged prompts, token for token; the whole engine check (chunked prefill,
    a prefix-cache hit) on act-order GPTQ, whose step permutes the activations."""
    fmt, options = SCHEMES[name]
    src = llama(tmp_path)
    reference = quantize_checkpoint(src, str(tmp_path / "q"), fmt, **options)
    hf_model = hf_reference(src, reference, tmp_path / "ref")
    if name == "gptq_int4_asym_act_order":
        assert_matches_hf(tmp_path / "q", hf_model, ragged_prompts(TINY_SHAPES["vocab_size"]))
        return
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(1, 17, 33))
    expected = [hf_greedy_ignoring_eos(hf_model, p, 12) for p in prompts]
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_per_group_targets_and_ignore_entries_are_honoured(tmp_path):
    """Attention int8 by channel, the MLP int4 in groups ("mixed" formats), layer 1's down_proj
    ignored (left in float): each param as its group says, decoding like HF."""
    src = llama(tmp_path)
    groups = {"re:.*self_attn\\..*": "W8A16", "re:.*mlp\\..*": "W4A16"}
    reference = quantize_checkpoint(
        src,
        str(tmp_path / "q"),
        "compressed-tensors",
        groups=groups,
        group_size=32,
        ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"),
    )
    assert "model.layers.1.mlp.down_proj.weight" not in reference
    _, params, _ = load_model(str(tmp_path / "q"), dtype="float32")
    layers = params["layers"]
    assert layers["attn"]["qkv"]["weight"].bits == 8
    assert layers["mlp"]["gate_up"]["weight"].bits == 4
    # One layer of the stack in float: the whole stacked param reads dequantized floats.
    assert not is_quantized(layers["mlp"]["down"]["weight"])
    hf_model = hf_reference(src, reference, tmp_path / "ref")
    prompts = ragged_prompts(TINY_SHAPES["vocab_size"], lengths=(3, 19))
    expected = [hf_greedy_ignoring_eos(hf_model, p, 8) for p in prompts]
    llm = LLM(str(tmp_path / "q"), dtype="float32", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == (
        expected
    )


def _write_config(tmp_path, quantization_config: dict) -> str:
    config = transformers.LlamaConfig(**TINY_SHAPES).to_dict()
    config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


_CT_GROUP = {"targets": ["Linear"], "format": "pack-quantized"}
_CT_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}


@pytest.mark.parametrize(
    "quantization_config,message",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0 is not supported"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "checkpoint_format='marlin' is not supported",
        ),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": 128}, "weight_block_size=128 is not"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "format": "float-quantized",
                        "weights": {"num_bits": 8, "type": "float", "strategy": "block"},
                    }
                },
            },
            "block_structure=None is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"group_0": {**_CT_GROUP, "weights": _CT_WEIGHTS}},
                "transform_config": {"config_groups": {"R1": {"type": "hadamard"}}},
            },
            "transform_config=.* is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {**_CT_WEIGHTS, "group_size": 128},
                    }
                },
                "format": "marlin-24",
            },
            "format='marlin-24' is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {**_CT_GROUP, "weights": {**_CT_WEIGHTS, "num_bits": 2}}
                },
            },
            "num_bits=2 is not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {**_CT_GROUP, "weights": {**_CT_WEIGHTS, "strategy": "tensor"}}
                },
            },
            "strategy='tensor' is not supported",
        ),
    ],
)
def test_unsupported_quantization_config_is_refused_naming_the_field(
    tmp_path, quantization_config, message
):
    with pytest.raises(ValueError, match=message):
        checkpoint_quantization({"quantization_config": quantization_config})
    # The engine refuses it from config.json alone, before any weight is read.
    path = _write_config(tmp_path, quantization_config)
    with pytest.raises(ValueError, match=message):
        LLM(path, dtype="float32", max_model_len=64)


def test_explicit_quantization_that_disagrees_with_the_checkpoint_names_both(tmp_path):
    src = llama(tmp_path)
    quantize_checkpoint(src, str(tmp_path / "q"), "gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="quantization='awq' disagrees.*'gptq'"):
        LLM(str(tmp_path / "q"), quantization="awq", max_model_len=64)
    with pytest.raises(ValueError, match="quantization='gptq' names a pre-quantized"):
        LLM(src, quantization="gptq", max_model_len=64)


@pytest.mark.parametrize(
    "quantization_config",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
        {"quant_method": "fp8", "weight_block_size": [128, 128]},
    ],
)
def test_prequantized_checkpoints_are_known_before_the_load(tmp_path, quantization_config):
    """The worker starts the grouped kernel's build (integer groups, FP8 blocks) from
    config.json alone."""
    assert is_prequantized(_write_config(tmp_path, quantization_config))
    float_dir = tmp_path / "float"
    float_dir.mkdir()
    (float_dir / "config.json").write_text(transformers.LlamaConfig(**TINY_SHAPES).to_json_string())
    assert not is_prequantized(str(float_dir))
