"""Phi-1, Phi-1.5 and Phi-2 (PhiForCausalLM) as flax.nnx modules, on the LayerNorm rotary layers
(models/layer_norm_rotary.py), read as HF's modeling_phi.py runs it:
- one LayerNorm feeding attention and the MLP in parallel: x + attn(ln(x)) + mlp(ln(x));
- q|k|v and the output projection ("dense") biased, rotary embeddings over the first
  `partial_rotary_factor` (default 0.5; Phi-2's 0.4) of each head;
- with `qk_layernorm`, one LayerNorm over H (weight and bias) for every head of q, another for
  k, before the rotary embeddings;
- fc1 / fc2 MLP with biases (gelu_new), a final LayerNorm, and an LM head WITH a bias (its
  weight tied to the embedding where the config ties it, the bias still its own).

Only the transformers layout is read (model.layers.*.self_attn.q_proj ...); the first
microsoft/phi-* checkpoints' own layout (transformer.h.*.mixer.Wqkv) is not.
"""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.layer_norm_rotary_decoder import decoder_options
from jvllm.models.layer_norm_rotary import LayerNormRotaryForCausalLM, layer_norm_rotary_config
from jvllm.models.weights import CheckpointWeights
from jvllm.rope_config import ROTARY_FRACTION_KEY, hf_partial_rotary_factor

# What PhiConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "hidden_act": "gelu_new",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_PARTIAL_ROTARY_FACTOR = 0.5


class PhiForCausalLM(LayerNormRotaryForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        cfg = {**_DEFAULTS, **cfg}
        cfg[ROTARY_FRACTION_KEY] = hf_partial_rotary_factor(cfg, _PARTIAL_ROTARY_FACTOR)
        cfg.update(attention_bias=True, sliding_window=None)
        options = decoder_options(
            residual="parallel_shared_norm",
            mlp_bias=True,
            o_proj_bias=True,
            qk_layernorm="shared" if cfg.get("qk_layernorm") else None,
            lm_head_bias=True,
        )
        return layer_norm_rotary_config(cfg, eps_key="layer_norm_eps", options=options)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params."""
        cls.load_model_prefixed_input(weights, qkv_bias=True)
        if config.option("qk_layernorm"):
            cls.load_layer_norm(weights, "layers.attn.q_norm", "self_attn.q_layernorm")
            cls.load_layer_norm(weights, "layers.attn.k_norm", "self_attn.k_layernorm")
        cls.load_linear(weights, "layers.attn.o", ("self_attn.dense",), True)
        cls.load_linear(weights, "layers.mlp.up", ("mlp.fc1",), True)
        cls.load_linear(weights, "layers.mlp.down", ("mlp.fc2",), True)
        cls.load_head(config, weights, "model.final_layernorm")
