"""An EAGLE-1 draft head (speculative decoding's "eagle" method), as its HF checkpoints are
published (yuhuili/EAGLE-*: a LlamaForCausalLM config of one layer, `fc` and `layers.0.*`, no
norm, no LM head), loaded as vLLM's EagleLlamaForCausalLM.

At position j the head folds the embedding of the token at j + 1 (the target's table) and the
target's final hidden state at j (after its final norm, as the target's LM head reads it) into
one row (`fc` over the two side by side), runs one Llama decoder layer without its input norm,
and the target's own LM head reads the layer's output as it is; that output is also the row
the head's next draft step reads. Its KV cache is its own one layer. The engine side is
worker/eagle.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.activation import check_activation
from jvllm.layers.attention import Attention, AttentionFn
from jvllm.layers.linear import Linear
from jvllm.layers.mlp import GatedMLP
from jvllm.layers.norm import RMSNorm
from jvllm.layers.rotary import rope_cos_sin
from jvllm.models.weights import CheckpointWeights


def check_one_layer(cfg: dict, head: str) -> None:
    """A ValueError for a draft head's config.json of other than one decoder layer."""
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{head} with num_hidden_layers={cfg['num_hidden_layers']} is not supported; "
            "allowed: 1 (the published heads' one decoder layer)"
        )


class EagleHead(nnx.Module):
    is_draft_head = True  # speculative_config's model, never an engine's own (registry.py)
    # Its drafts come from the target's LM head over its rows (worker/eagle.py).
    uses_target_lm_head = True

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        check_one_layer(cfg, "an EAGLE head")
        if cfg.get("add_para_norm"):
            raise ValueError("an EAGLE head with add_para_norm (HASS) is not supported")
        cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
        cfg["sliding_window"] = None
        return cfg

    @staticmethod
    def target_layer_ids(head: ModelConfig, target: ModelConfig) -> None:
        """None: it reads the target's final hidden states (eagle3.py's read layers' inputs)."""
        return

    def __init__(self, config: ModelConfig):
        d, dtype = config.hidden_size, jnp.dtype(config.dtype)
        self.config = config
        # EAGLE's training code gives fc a bias; vLLM's loader none: a checkpoint without one
        # loads zeros.
        self.fc = Linear(2 * d, d, ("embed", "embed"), dtype=dtype, bias=True)
        self.attn = Attention(config)
        self.post_attention_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def combine(self, rows: jax.Array) -> jax.Array:
        """The target's final hidden rows f32[T, D] are the hidden rows as they are."""
        return rows

    def __call__(
        self, kv_cache, embeds, hidden, positions, metadata, attn: AttentionFn
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The next tokens' embeddings f32[T, D] and hidden rows f32[T, D] at `positions`
        i32[T] -> (the row for the target's LM head, the row for the next draft step: the
        same f32[T, D], kv_cache)."""
        x = self.fc(jnp.concatenate([embeds, hidden], axis=-1))  # [T, D]
        cos, sin = rope_cos_sin(positions, self.config)
        out, kv_cache = self.attn(x, jnp.int32(0), cos, sin, kv_cache, metadata, attn)
        x = x + out
        x = x + self.mlp(self.post_attention_norm(x))
        return x, x, kv_cache

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        prefix = "layers.0."
        if not weights.has("fc.weight"):
            raise ValueError("the EAGLE checkpoint has no fc.weight: not an EAGLE-1 head")
        weights.tensor("fc.weight", "fc.weight")
        if weights.has("fc.bias"):
            weights.tensor("fc.bias", "fc.bias")
        else:
            weights.value("fc.bias", np.zeros((), np.float32))
        for path, name in (
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("attn.o.weight", "self_attn.o_proj.weight"),
            ("mlp.down.weight", "mlp.down_proj.weight"),
        ):
            weights.tensor(path, prefix + name)
        qkv = [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
        weights.concatenated("attn.qkv.weight", qkv)
        gate_up = [prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up")]
        weights.concatenated("mlp.gate_up.weight", gate_up)

    @staticmethod
    def is_read_elsewhere(config: ModelConfig, name: str) -> bool:
        """The checkpoint's copy of the target's embeddings: the head reads the target's."""
        return name == "embed_tokens.weight"
