"""Arcee (ArceeForCausalLM: Arcee's AFM-4.5B) on Llama's modules (models/llama.py), read as HF's
modeling_arcee.py runs it: Llama's blocks with an ungated MLP, down(act(up(x))), its activation
ReLU squared by default (`hidden_act` "relu2")."""

from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.layers.mlp import MLP
from jvllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jvllm.models.weights import CheckpointWeights

# What ArceeConfig assumes where a config.json says nothing.
_DEFAULTS = {
    "hidden_act": "relu2",
    "max_position_embeddings": 4096,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


class ArceeDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def dense_mlp(config: ModelConfig) -> MLP:
        return MLP(config, bias=config.option("mlp_bias", False))


class ArceeForCausalLM(LlamaForCausalLM):
    decoder_layer = ArceeDecoderLayer

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        return LlamaForCausalLM.normalize_hf_config({**_DEFAULTS, **cfg})

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        for part in ("up", "down"):
            weights.stacked(f"layers.mlp.{part}.weight", (f"mlp.{part}_proj.weight",))
            if config.option("mlp_bias", False):
                weights.stacked(f"layers.mlp.{part}.bias", (f"mlp.{part}_proj.bias",))
