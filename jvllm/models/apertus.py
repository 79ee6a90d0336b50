"""Apertus (ApertusForCausalLM: Swiss AI's Apertus-8B, -70B) on Llama's modules (models/llama.py),
read as HF's modeling_apertus.py runs it: Llama's blocks (their norms named attention_layernorm
and feedforward_layernorm) with per-head q/k norms, Llama 3's rope scaling by default, and an
ungated MLP, down(act(up(x))), whose activation is xIELU by default: with the layer's learned
alpha_p, alpha_n and its beta, eps,

    xielu(x) = ap * x^2 + beta * x                          where x > 0,
               (expm1(min(x, eps)) - x) * an + beta * x     elsewhere,

ap = softplus(alpha_p), an = beta + softplus(alpha_n), computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.mlp import MLP
from jvllm.layers.params import param
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights

# What ApertusConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "hidden_act": "xielu",
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_DEFAULT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 12_000_000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
# xIELU's four values a layer, in the order its `xielu` param holds them.
_XIELU_VALUES = ("alpha_p", "alpha_n", "beta", "eps")


def _normalize(cfg: dict) -> dict:
    cfg = {**_DEFAULTS, **cfg}
    if not any(cfg.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        cfg["rope_parameters"] = dict(_DEFAULT_ROPE)
    is_xielu = cfg["hidden_act"] == "xielu"
    if is_xielu:  # learned a layer: XIELUMLP's own, so hidden_act's placeholder is never read
        cfg["hidden_act"] = "silu"
    cfg = LlamaForCausalLM.normalize_hf_config(cfg)
    cfg["qk_norm"] = True
    cfg["options"] = {**cfg.get("options", {}), "xielu": is_xielu}
    return cfg


class XIELUMLP(MLP):
    """MLP with xIELU in place of its activation, its four values a layer in `xielu` [4]
    (alpha_p, alpha_n, beta, eps; the "embed" name only keeps them whole on every device)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, bias=False)
        self.xielu = param((len(_XIELU_VALUES),), jnp.float32, ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        alpha_p, alpha_n, beta, eps = (self.xielu[...][i] for i in range(len(_XIELU_VALUES)))
        h = self.up(x).astype(jnp.float32)  # [T, F]
        positive = jax.nn.softplus(alpha_p) * h * h + beta * h
        scale = beta + jax.nn.softplus(alpha_n)
        negative = (jnp.expm1(jnp.minimum(h, eps)) - h) * scale + beta * h
        return self.down(jnp.where(h > 0, positive, negative))  # [T, D]


class ApertusDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def dense_mlp(config: ModelConfig) -> nnx.Module:
        return XIELUMLP(config) if config.option("xielu") else MLP(config, bias=False)


class ApertusForCausalLM(LlamaForCausalLM):
    decoder_layer = ApertusDecoderLayer
    normalize_hf_config = staticmethod(_normalize)
    norm_names = ("attention_layernorm", "feedforward_layernorm")

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        weights.stacked("layers.mlp.up.weight", ("mlp.up_proj.weight",))
        weights.stacked("layers.mlp.down.weight", ("mlp.down_proj.weight",))
        if config.option("xielu"):
            names = tuple(f"mlp.act_fn.{name}" for name in _XIELU_VALUES)
            weights.stacked("layers.mlp.xielu", names, lambda v: v.reshape(1))
