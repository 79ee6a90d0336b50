"""The Llama family (Llama, Mistral, Qwen2, Qwen3) through the engine against HF transformers; a
Qwen2 model from its GGUF too."""

import pytest
import torch
import transformers
from family_parity import (
    TINY_SHAPES,
    assert_hf_window_cuts,
    assert_matches_hf,
    ragged_prompts,
    save_random_model,
)
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jvllm.model_loader.hf_config import model_config_from_hf

TINY = TINY_SHAPES
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
    # Biases on q, k, v and o_proj (Qwen2's have none on o_proj) and on the MLP's three
    # projections, and another activation than SiLU.
    "llama_biased_gelu": lambda: transformers.LlamaConfig(
        **TINY, attention_bias=True, mlp_bias=True, hidden_act="gelu"
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_decodes_like_hf(tmp_path, name):
    hf_model = save_random_model(tmp_path, CONFIGS[name]())
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


def test_a_sliding_window_in_a_llama_config_is_not_applied(tmp_path):
    """HF's Llama attends globally whatever its config says (its forward does; its generate's
    cache would cut at the window from the first decode step, so the reference is the model
    without the key)."""
    hf_model = save_random_model(tmp_path, transformers.LlamaConfig(**TINY, sliding_window=8))
    hf_model.config.sliding_window = None
    assert_matches_hf(tmp_path, hf_model, ragged_prompts(TINY["vocab_size"]))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_windows_of_a_config_without_the_keys_are_hf_defaults(model_type):
    """use_sliding_window with no sliding_window nor max_window_layers: HF's 4096 from layer 28."""
    fields = {"model_type": model_type, "use_sliding_window": True, "num_hidden_layers": 30}
    hf = transformers.AutoConfig.for_model(**fields)
    config = model_config_from_hf({**TINY, **fields}, "float32")
    expected = [4096 if t == "sliding_attention" else None for t in hf.layer_types]
    assert hf.sliding_window == 4096 and list(config.layer_windows) == expected


def test_mistral_sliding_window_decodes_like_hf(tmp_path):
    """Mistral's window (8 positions, pages of 4) cuts the long prompts, their decodes and the
    prefix hit, whose first pages fall wholly outside it."""
    config = transformers.MistralConfig(**TINY, sliding_window=8, attn_implementation="eager")
    hf_model = save_random_model(tmp_path, config)
    prompts = ragged_prompts(TINY["vocab_size"])
    assert_hf_window_cuts(hf_model, max(prompts, key=len))
    assert_matches_hf(tmp_path, hf_model, prompts, block_size=4)


# HF's names of a Qwen2 layer's tensors -> llama.cpp's (after "model.layers.{i}." / "blk.{i}.").
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _save_qwen2_gguf(hf_model, path: str) -> None:
    """hf_model as llama.cpp writes a Qwen2 GGUF (q and k rows in HF's order), its matmul
    weights in Q8_0 and loaded back into hf_model as their dequantized values, so that both
    compute with the same weights; the tokenizer a byte-level vocabulary of placeholders."""
    config = hf_model.config
    writer = GGUFWriter(path, arch="qwen2")
    for key, value in {
        "block_count": config.num_hidden_layers,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "context_length": config.max_position_embeddings,
    }.items():
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.rope.freq_base", config.rope_parameters["rope_theta"])
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_merges([])
    state = hf_model.state_dict()
    for name, tensor in state.items():
        values = tensor.numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if values.ndim == 2 and gguf_name.startswith("blk."):
            blocks = gguf_quantize(values, Q.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=Q.Q8_0)
            dequantized = gguf_dequantize(blocks, Q.Q8_0).reshape(values.shape)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(dequantized))
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen2_gguf_decodes_like_hf(tmp_path):
    """A Qwen2 GGUF (biased q/k/v, q and k not reordered), its Q8_0 weights kept packed."""
    hf_model = save_random_model(tmp_path / "hf", CONFIGS["qwen2"]())
    path = str(tmp_path / "qwen2.gguf")
    _save_qwen2_gguf(hf_model, path)
    assert_matches_hf(path, hf_model, ragged_prompts(TINY["vocab_size"]), quantization="gguf")
