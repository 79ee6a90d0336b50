"""GGUF files of each llama.cpp architecture jvllm reads, written from a tiny random HF model as
llama.cpp's converter writes that architecture (matmul weights in Q8_0, a MoE file's experts
also in Q4_K and MXFP4): each loads as the HF checkpoint it was written from, and the more
involved ones decode like HF transformers with their weights kept packed."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import random_gguf_blocks
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
# MoE layers (the same HF names in Qwen3-MoE, Qwen2-MoE and Mixtral in memory): the router,
# Qwen2-MoE's shared expert and its q/k/v biases; the experts go through _add_experts.
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
# HF's fused experts [E, 2F, D] (gate | up) and [E, D, F] -> llama.cpp's kinds of expert tensor.
_EXPERT_KINDS = {
    "mlp.experts.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.experts.down_proj": ("ffn_down",),
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
    `extra_tensors` ({name: f32 array}), and the experts' (see _add_experts). Routers stay
    float32, as llama.cpp keeps them."""
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
        if name.split(".", 3)[-1] in _EXPERT_KINDS:
            _add_experts(writer, name, tensor, **conventions)
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
        if values.ndim == 2 and gguf_name.startswith("blk.") and "gate_inp" not in gguf_name:
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


def _add_experts(writer, name: str, tensor, expert_qtypes=None, per_expert=False, **_) -> None:
    """HF's fused experts `name` as llama.cpp's 3-D ffn_{gate,up,down}_exps [E, out, in] (or,
    `per_expert`, old Mixtral files' ffn_*.{j} [out, in]), each kind in expert_qtypes' format
    ({kind: qtype}, else Q8_0); the HF tensor gets the values the file holds."""
    _, _, layer, rest = name.split(".", 3)
    kinds = _EXPERT_KINDS[rest]
    stored = []
    for kind, values in zip(kinds, np.split(tensor.numpy(), len(kinds), axis=1)):
        qtype = (expert_qtypes or {}).get(kind, Q.Q8_0)
        blocks = _encoded(values, qtype)  # [E, out, bytes]
        stored.append(gguf_dequantize(blocks, qtype).reshape(values.shape))
        if per_expert:
            for j, expert in enumerate(blocks):
                writer.add_tensor(f"blk.{layer}.{kind}.{j}.weight", expert, raw_dtype=qtype)
        else:
            writer.add_tensor(f"blk.{layer}.{kind}_exps.weight", blocks, raw_dtype=qtype)
    tensor.copy_(torch.from_numpy(np.concatenate(stored, axis=1)))


def _encoded(values: np.ndarray, qtype) -> np.ndarray:
    """values [..., I] in `qtype`'s blocks (u8 [..., bytes]): gguf's quantizer, or for Q4_K
    (which gguf cannot quantize) random blocks with scales small enough for O(0.1) values."""
    if qtype != Q.Q4_K:
        return gguf_quantize(values, qtype)
    rows = int(np.prod(values.shape[:-1]))
    blocks = random_gguf_blocks(qtype, (rows, values.shape[-1] // 256), np.random.default_rng(0))
    blocks["d"] = blocks["dmin"] = np.float16(3e-4)
    return blocks.view(np.uint8).reshape(*values.shape[:-1], -1)


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


def _moe_metadata(config, num_experts: int) -> dict:
    return {
        "rope.freq_base": _theta(config),
        "expert_count": num_experts,
        "expert_used_count": config.num_experts_per_tok,
    }


def _qwen3_moe():
    """Top-2 of 4 experts renormalised (as llama.cpp always runs qwen3moe), q/k norms; the
    experts' down projections in Q4_K (rows of 256), their gate and up in Q8_0."""
    config = transformers.Qwen3MoeConfig(
        **TINY,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        norm_topk_prob=True,
    )
    metadata = {**_moe_metadata(config, 4), "expert_feed_forward_length": 256}
    conventions = {"expert_qtypes": {"ffn_down": Q.Q4_K}}
    return config, "qwen3moe", _MOE_LAYER_NAMES, metadata, conventions


def _qwen2_moe():
    """Top-2 of 8 experts, not renormalised (as llama.cpp always runs qwen2moe), beside the
    gated shared expert of its own width; q/k/v biases. The experts' gate projections in MXFP4
    (a format the packed path does not keep), their down ones in Q4_K."""
    config = transformers.Qwen2MoeConfig(
        **TINY,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=96,
    )
    metadata = {
        **_moe_metadata(config, 8),
        "expert_feed_forward_length": 256,
        "expert_shared_feed_forward_length": 96,
    }
    conventions = {"expert_qtypes": {"ffn_gate": Q.MXFP4, "ffn_down": Q.Q4_K}}
    return config, "qwen2moe", _MOE_LAYER_NAMES, metadata, conventions


def _mixtral(per_expert: bool = False):
    """Written as a Llama with experts (q and k rows reordered), each intermediate_size wide;
    `per_expert`: as old files, one tensor an expert (ffn_gate.{j})."""
    config = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    conventions = {"permute_qk": True, "per_expert": per_expert}
    return config, "llama", _MOE_LAYER_NAMES, _moe_metadata(config, 4), conventions


CASES = {
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "mixtral_per_expert": lambda: _mixtral(per_expert=True),
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


@pytest.mark.parametrize(  # Gemma 3's GGUF decodes in the slow job; it loads as HF's above
    "case", ["mistral", pytest.param("gemma3", marks=pytest.mark.slow), "phi3", "qwen2_moe"]
)
def test_a_packed_gguf_decodes_like_hf(tmp_path, case):
    """Through the engine, Q8_0 kept packed: Llama's reordered q/k blocks and Mistral's window;
    Gemma 3's local and global layers; Phi-3's fused blocks, partial rotation and LongRoPE
    (its short factors: within the original context, where HF uses them too); Qwen2-MoE's
    experts (MXFP4, Q8_0, Q4_K) dequantized beside its packed attention and shared expert."""
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
        ("qwen3moe", {"expert_used_count": 2}, "expert_count=None and qwen3moe.expert_used"),
        (
            "qwen2moe",
            {"expert_count": 4, "expert_used_count": 2, "expert_gating_func": 2},
            "expert_gating_func=2 and qwen2moe.expert_weights_scale=0.0 are not supported",
        ),
        (
            "llama",
            {"expert_count": 4, "expert_used_count": 2, "expert_weights_scale": 2.5},
            "expert_weights_scale=2.5 are not supported",
        ),
    ],
)
def test_what_jvllm_cannot_run_is_refused(tmp_path, arch, metadata, message):
    config = transformers.Qwen3Config(**TINY, head_dim=16)
    with torch.no_grad():
        hf_model = transformers.Qwen3ForCausalLM(config).eval()
        _save_gguf(hf_model, tmp_path / "x.gguf", arch, _LAYER_NAMES, metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf(str(tmp_path / "x.gguf"))
