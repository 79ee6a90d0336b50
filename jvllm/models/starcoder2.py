"""Starcoder2 (Starcoder2ForCausalLM) as flax.nnx modules, on the LayerNorm rotary layers
(models/layer_norm_rotary.py), read as HF's modeling_starcoder2.py runs it: sequential pre-norm
layers with LayerNorms (always biased), rotary embeddings over whole heads, q/k/v/o and the
c_fc / c_proj MLP (gelu_pytorch_tanh) biased where `use_bias` (default True), every layer
windowed where `sliding_window` is set, and the LM head tied to the embedding by default.
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import LayerNormRotaryForCausalLM, layer_norm_rotary_config
from jvllm.models.weights import CheckpointWeights

# What Starcoder2Config assumes where a config.json says nothing.
_DEFAULTS = {
    "num_key_value_heads": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 4096,
    "use_bias": True,
    "tie_word_embeddings": True,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}


class Starcoder2ForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        bias = bool(cfg["use_bias"])
        cfg["attention_bias"] = bias
        # HF's rotary embedding turns whole heads, whatever partial_rotary_factor says (no
        # rotary fraction is set); layer_types is not read: every layer has the one window.
        cfg.pop("layer_types", None)
        options = decoder_options(residual="sequential", mlp_bias=bias, o_proj_bias=bias)
        return layer_norm_rotary_config(cfg, eps_key="norm_epsilon", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        bias = config.attention_bias
        cls.load_model_prefixed_input(weights, bias)
        cls.load_linear(weights, "layers.attn.o", ("self_attn.o_proj",), bias)
        cls.load_layer_norm(weights, "layers.mlp_norm", "post_attention_layernorm")
        cls.load_linear(weights, "layers.mlp.up", ("mlp.c_fc",), bias)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.c_proj",), bias)
        cls.load_head(config, weights, "model.norm")
