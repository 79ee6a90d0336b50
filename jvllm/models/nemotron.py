"""Nemotron (NemotronForCausalLM: Nemotron-4, Nemotron-Mini-4B, Minitron) on the LayerNorm rotary
layers (models/layer_norm_rotary.py), read as HF's modeling_nemotron.py runs it: sequential
pre-norm blocks whose LayerNorms scale by 1 + weight (LayerNorm1P: the weight is loaded plus
one), rotary embeddings over the first half of each head by default, biases on every attention
projection where `attention_bias`, and an ungated MLP, ReLU squared by default."""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import LayerNormRotaryForCausalLM, layer_norm_rotary_config
from jvllm.models.weights import CheckpointWeights
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What NemotronConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "hidden_act": "relu2",
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "bos_token_id": 2,
    "eos_token_id": 3,
    "attention_bias": False,
    "mlp_bias": False,
}
_PARTIAL_ROTARY_FACTOR = 0.5


def _plus_one(weight):
    """LayerNorm1P's weight as a plain LayerNorm's: 1 + weight."""
    return weight + 1.0


class NemotronForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        if cfg.get("head_dim") is None:
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg[ROTARY_FRACTION_KEY] = hf_partial_rotary_factor(cfg, _PARTIAL_ROTARY_FACTOR)
        cfg["sliding_window"] = None
        bias = bool(cfg["attention_bias"])
        options = decoder_options(
            residual="sequential", mlp_bias=bool(cfg["mlp_bias"]), o_proj_bias=bias
        )
        return layer_norm_rotary_config(cfg, eps_key="norm_eps", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        weights.set_layer_prefix("model.layers.{}.")
        weights.tensor("embed.embedding", "model.embed_tokens.weight")
        for path, name in (
            ("layers.attn_norm", "input_layernorm"),
            ("layers.mlp_norm", "post_attention_layernorm"),
        ):
            weights.stacked(f"{path}.weight", (f"{name}.weight",), transform=_plus_one)
            weights.stacked(f"{path}.bias", (f"{name}.bias",))
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        cls.load_linear(weights, "layers.attn.qkv", qkv, config.attention_bias)
        cls.load_linear(weights, "layers.attn.o", ("self_attn.o_proj",), config.attention_bias)
        mlp_bias = config.option("mlp_bias")
        cls.load_linear(weights, "layers.mlp.up", ("mlp.up_proj",), mlp_bias)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.down_proj",), mlp_bias)
        weights.tensor("final_norm.weight", "model.norm.weight", _plus_one)
        weights.tensor("final_norm.bias", "model.norm.bias")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", "lm_head.weight")
