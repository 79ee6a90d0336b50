"""GGUF files of each llama.cpp architecture jvllm reads, written from a tiny random HF model as
llama.cpp's converter writes that architecture (matmul weights in Q8_0): each loads as the HF
checkpoint it was written from, and the more involved ones decode like HF transformers with
their weights kept packed."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers
from family_parity import TINY_SHAPES, assert_matches_hf, ragged_prompts, save_random_model
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jvllm.model_loader import load_gguf
from jvllm.model_loader.hf import load_hf_dir

TINY = {**TINY_SHAPES, "attn_implementation": "eager"}  # HF applies windows and caps in eager
WINDOW = 8  # with pages of 4, the long prompts and the prefix hit leave whole pages behind
PROMPTS = ragged_prompts(TINY["vocab_size"], lengths=(1, 17, 45))

# HF's names of a layer's tensors -> llama.cpp's (after "model.layers.{i}." / "blk.{i}.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 2 and 3: four norms a layer, HF's post-attention norm no longer the one before the MLP.
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Phi-3: HF's fused tensors, kept fused.
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _permuted(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Llama q/k row order: within a head, HF row s * H/2 + j is row 2j + s."""
    heads = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, -1)
    return heads.swapaxes(1, 2).reshape(rows.shape)


def _save_gguf(hf_model, path, arch: str, layer_names: dict, metadata: dict, **conventions):
    """hf_model as llama.cpp's converter writes `arch`: its metadata, then `metadata` ({key
    after "{arch}.": int, float or str}); layer matmul weights in Q8_0, loaded back into
    hf_model as their dequantized values so that both compute with the same weights; a tied
    head left out; the tokenizer a byte-level vocabulary of placeholders. Conventions:
    `permute_qk` (Llama's q/k rows), `norm_shift` (Gemma's: its norms stored + 1),
    `extra_tensors` ({name: f32 array})."""
    config = hf_model.config
    writer = GGUFWriter(str(path), arch=arch)
    common = {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
    }
    if getattr(config, "head_dim", None):  # Phi-3's config has none, nor does its file
        common["attention.key_length"] = common["attention.value_length"] = config.head_dim
    for key, value in {**common, **metadata}.items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        add[type(value)](f"{arch}.{key}", value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_merges([])
    for key, value in (("bos", config.bos_token_id), ("eos", config.eos_token_id)):
        if value is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    heads = {
        "attn_q.weight": config.num_attention_heads,
        "attn_k.weight": config.num_key_value_heads,
    }
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        else:
            gguf_name = _GLOBAL_NAMES[name]
        values = tensor.numpy()
        if name.endswith("norm.weight") and conventions.get("norm_shift"):
            values = values + np.float32(1.0)
            tensor.copy_(torch.from_numpy(values - np.float32(1.0)))  # what the file holds
        if values.ndim == 2 and gguf_name.startswith("blk."):
            stored = gguf_dequantize(gguf_quantize(values, Q.Q8_0), Q.Q8_0).reshape(values.shape)
            tensor.copy_(torch.from_numpy(stored))
            suffix = gguf_name.split(".", 2)[2]
            if conventions.get("permute_qk") and suffix in heads:
                values = _permuted(values, heads[suffix])  # Q8_0 blocks are within a row
            writer.add_tensor(gguf_name, gguf_quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(gguf_name, values)
    for name, values in conventions.get("extra_tensors", {}).items():
        writer.add_tensor(name, np.asarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _qwen3():
    """q/k norms, a head_dim (key_length) that is not D / N."""
    config = transformers.Qwen3Config(**TINY, head_dim=32)
    return config, "qwen3", _LAYER_NAMES, {"rope.freq_base": _theta(config)}, {}


def _mistral():
    """Llama's converter writes Mistral as a Llama (q and k rows reordered), without its window;
    one given as llama.attention.sliding_window cuts as Mistral's."""
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    metadata = {
        "rope.freq_base": _theta(config),
        "rope.dimension_count": config.head_dim,
        "attention.sliding_window": WINDOW,
    }
    return config, "llama", _LAYER_NAMES, metadata, {"permute_qk": True}


def _gemma():
    """Norms stored + 1, the head tied, GeLU; no rope base (llama.cpp's default 10000)."""
    config = transformers.GemmaConfig(**TINY, head_dim=16)
    return config, "gemma", _LAYER_NAMES, {}, {"norm_shift": True}


def _gemma2():
    """Four norms a layer, a window on every other layer, both soft-caps."""
    config = transformers.Gemma2Config(
        **TINY,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,  # llama.cpp's scale for all but the 27B model: H^-1/2
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
    )
    metadata = {
        "attention.sliding_window": WINDOW,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 5.0,
    }
    return config, "gemma2", _GEMMA2_LAYER_NAMES, metadata, {"norm_shift": True}


def _gemma3():
    """q/k norms; a global layer every 2nd (sliding_window_pattern), its rope linearly scaled,
    the windowed layers' on their own base (rope.freq_base_swa)."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    config = transformers.Gemma3TextConfig(
        **TINY,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
        rope_parameters=rope,
    )
    metadata = {
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 100.0,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0,
        "attention.sliding_window": WINDOW,
        "attention.sliding_window_pattern": 2,
    }
    return config, "gemma3", _GEMMA2_LAYER_NAMES, metadata, {"norm_shift": True}


PHI3_ORIGINAL_CONTEXT = 64


def _phi3():
    """Fused q|k|v and gate|up, half of each head rotating, LongRoPE's factor sets as tensors,
    the head tied (as Phi-4-mini's), no window (written as 0)."""
    original, max_len, num_pairs = PHI3_ORIGINAL_CONTEXT, 256, 4  # half of head_dim 16 rotates
    short = [1.0 + 0.5 * i for i in range(num_pairs)]
    long = [2.0 + 3.0 * i for i in range(num_pairs)]
    config = transformers.Phi3Config(
        **{**TINY, "max_position_embeddings": max_len},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        original_max_position_embeddings=original,
        partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long},
        tie_word_embeddings=True,
    )
    metadata = {
        "rope.freq_base": _theta(config),
        "rope.dimension_count": 2 * num_pairs,
        "rope.scaling.original_context_length": original,
        "rope.scaling.attn_factor": float(
            np.sqrt(1 + np.log(max_len / original) / np.log(original))
        ),
        "attention.sliding_window": 0,
    }
    factors = {"rope_factors_long.weight": long, "rope_factors_short.weight": short}
    return config, "phi3", _PHI3_LAYER_NAMES, metadata, {"extra_tensors": factors}


CASES = {
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}


def _theta(config) -> float:
    return float(config.rope_parameters["rope_theta"])


def _gguf_of(tmp_path, case: str):
    """(the HF model, saved in tmp_path / "hf" with the file's weights; the GGUF's path)."""
    hf_config, arch, layer_names, metadata, conventions = CASES[case]()
    with torch.no_grad():
        hf_model = save_random_model(tmp_path / "hf", hf_config)
        if arch.startswith("gemma"):  # its sqrt(D) scale would drown what the layers add
            hf_model.model.embed_tokens.weight /= hf_config.hidden_size**0.5
        path = tmp_path / f"{case}.gguf"
        _save_gguf(hf_model, path, arch, layer_names, metadata, **conventions)
    hf_model.save_pretrained(tmp_path / "hf")
    return hf_model, str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_gguf_loads_as_the_hf_checkpoint_it_was_written_from(tmp_path, case):
    """Its config and weights are those jvllm reads from the HF directory (which
    test_family_*.py run against HF): every tensor name, reordering, shift and metadata key."""
    _, path = _gguf_of(tmp_path, case)
    config, params = load_gguf(path, "float32")
    want_config, want_params = load_hf_dir(str(tmp_path / "hf"), "float32")
    _assert_same_config(config, want_config)
    jax.tree.map(np.testing.assert_array_equal, params, want_params)


def _assert_same_config(got, want) -> None:
    """Field by field, floats to float32's precision (a GGUF's floats are float32s); no
    layer_types is every layer global."""
    for field in dataclasses.fields(want):
        value, wanted = getattr(got, field.name), getattr(want, field.name)
        if field.name == "layer_types":
            value, wanted = got.layer_windows, want.layer_windows
        if dataclasses.is_dataclass(wanted):
            _assert_same_config(value, wanted)
        elif isinstance(wanted, float):
            assert value == pytest.approx(wanted, rel=1e-6), field.name
        else:
            assert value == wanted, field.name


@pytest.mark.parametrize("case", ["mistral", "gemma3", "phi3"])
def test_a_packed_gguf_decodes_like_hf(tmp_path, case):
    """Through the engine, Q8_0 kept packed: Llama's reordered q/k blocks and Mistral's window;
    Gemma 3's local and global layers; Phi-3's fused blocks, partial rotation and LongRoPE
    (its short factors: within the original context, where HF uses them too)."""
    hf_model, path = _gguf_of(tmp_path, case)
    engine = {"block_size": 4}
    if case == "phi3":
        engine = {"max_model_len": PHI3_ORIGINAL_CONTEXT}
    prompts = PROMPTS if case != "phi3" else ragged_prompts(TINY["vocab_size"], (1, 17, 30))
    assert_matches_hf(path, hf_model, prompts, quantization="gguf", **engine)


@pytest.mark.parametrize(
    ("arch", "metadata", "message"),
    [
        ("falcon", {}, r"architecture 'falcon' is not supported; supported: \['llama'"),
        ("gemma3", {"attention.sliding_window_pattern": 0}, "sliding_window_pattern=0"),
        ("gemma2", {"rope.freq_base_swa": 100.0}, "gemma2.rope.freq_base_swa=100.0"),
        ("qwen3", {"rope.dimension_count": 8}, "rope over 8 of each head's 16 dims"),
        ("qwen3", {"attention.value_length": 8}, "value_length=8 is not supported"),
    ],
)
def test_what_jvllm_cannot_run_is_refused(tmp_path, arch, metadata, message):
    config = transformers.Qwen3Config(**TINY, head_dim=16)
    with torch.no_grad():
        hf_model = transformers.Qwen3ForCausalLM(config).eval()
        _save_gguf(hf_model, tmp_path / "x.gguf", arch, _LAYER_NAMES, metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf(str(tmp_path / "x.gguf"))
