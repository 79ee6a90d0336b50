"""GPT-2 (GPT2LMHeadModel) as flax.nnx modules: learned absolute positions, pre-norm LayerNorm
layers with biases everywhere (layers/layer_norm_decoder.py), a final LayerNorm, and an LM head
tied to the token embedding unless the config unties it.

The contract is in docs/design.md; the runner reaches the model through models/model.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import AttentionFn
from jvllm.layers.embedding import Embed, PositionEmbed
from jvllm.layers.layer_norm_decoder import LayerNormDecoderLayer
from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.weights import CheckpointWeights


def _conv1d(weight: np.ndarray) -> np.ndarray:
    """GPT-2's Conv1D stores its weight [in, out]; Linear's is torch's [out, in]."""
    return weight.T


class GPT2LMHeadModel(nnx.Module):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise ValueError(
                "scale_attn_by_inverse_layer_idx=True is not supported: it scales each layer's "
                "attention scores by 1 / (layer + 1), and attention here scales by head_dim**-0.5"
            )
        if not cfg.get("scale_attn_weights", True):
            raise ValueError(
                "scale_attn_weights=False is not supported: attention here scales the scores by "
                "head_dim**-0.5"
            )
        # reorder_and_upcast_attn only makes HF compute the scores and softmax in float32,
        # which attention here always does: it is accepted and changes nothing.
        hidden_size, num_heads = cfg["n_embd"], cfg["n_head"]
        cfg.update(
            hidden_size=hidden_size,
            num_hidden_layers=cfg["n_layer"],
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            head_dim=hidden_size // num_heads,
            intermediate_size=cfg.get("n_inner") or 4 * hidden_size,
            max_position_embeddings=cfg.get("n_positions", 1024),
            rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            hidden_act=check_activation(
                cfg.get("activation_function", "gelu_new"), "activation_function"
            ),
            attention_bias=True,
        )
        cfg.setdefault("tie_word_embeddings", True)  # older config.json files leave it out
        return cfg

    @staticmethod
    def layer_tensors(config: ModelConfig) -> tuple:
        """Each layer param's (path, HF name, weight transform, bias transform): GPT-2's
        Conv1D weights transposed."""
        return (
            ("attn_norm", "ln_1", None, None),
            ("attn.qkv", "attn.c_attn", _conv1d, None),  # q|k|v, as the fused param
            ("attn.o", "attn.c_proj", _conv1d, None),
            ("mlp_norm", "ln_2", None, None),
            ("mlp.up", "mlp.c_fc", _conv1d, None),
            ("mlp.down", "mlp.c_proj", _conv1d, None),
        )

    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        d = config.hidden_size
        self.embed = Embed(config.vocab_size, d, dtype=dtype, num_shards=config.num_shards)
        self.positions = PositionEmbed(config.max_position_embeddings, d, dtype=dtype)
        self.layers = stacked_layers(lambda: LayerNormDecoderLayer(config), config.num_layers)
        self.final_norm = LayerNorm(d, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(d, config.vocab_size, ("vocab", "embed"), dtype=dtype)
        )

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache)."""
        x = self.embed(token_ids) + self.positions(positions)  # [T, D]

        def body(layer_module, carry, layer, _):
            x, kv_cache = carry
            return layer_module(x, layer, kv_cache, metadata, attn)

        x, kv_cache = scan_layers(self.layers, body, (x, kv_cache))
        return self.final_norm(x), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V]."""
        if self.lm_head is None:
            return self.embed.attend(hidden)
        return self.lm_head(hidden)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params. GPT2LMHeadModel saves them
        under "transformer."; the original checkpoints (GPT2Model's) without it."""
        prefix = "transformer." if weights.has("transformer.wte.weight") else ""
        weights.set_layer_prefix(prefix + "h.{}.")
        weights.tensor("embed.embedding", prefix + "wte.weight")
        weights.tensor("positions.embedding", prefix + "wpe.weight")
        for path, name, transform, bias in cls.layer_tensors(config):
            weights.stacked(f"layers.{path}.weight", (f"{name}.weight",), transform=transform)
            weights.stacked(f"layers.{path}.bias", (f"{name}.bias",), transform=bias)
        weights.tensor("final_norm.weight", prefix + "ln_f.weight")
        weights.tensor("final_norm.bias", prefix + "ln_f.bias")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", "lm_head.weight")
