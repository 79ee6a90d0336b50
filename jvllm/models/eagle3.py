"""An EAGLE-3 draft head (speculative decoding's "eagle3" method), as its HF checkpoints are
published (LlamaForCausalLMEagle3: yuhuili/EAGLE3-*, and the heads trained the same way).

The head drafts from the target's own hidden states: `fc` folds the residual stream entering
three of the target's layers (its config's `eagle_aux_hidden_state_layer_ids`, else 2, L/2 and
L - 3) into one row a token, and one Llama decoder layer, whose attention reads the next
token's embedding (the target's embedding table) and that row side by side (2D features),
gives the hidden state that its own LM head, over a draft vocabulary of its own
(`draft_vocab_size`; `d2t` maps a draft id to the target's), reads. The layer's pre-norm output
is what the head's next draft step reads in place of the target's rows. Its KV cache is its own
one layer. The engine side is worker/eagle.py.
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
from jvllm.layers.parallel import gather_over_shards
from jvllm.layers.params import param
from jvllm.layers.rotary import rope_cos_sin
from jvllm.models.eagle1 import check_one_layer
from jvllm.models.weights import CheckpointWeights

# Where a checkpoint keeps the decoder layer: EAGLE's training code, or vLLM's speculators.
_LAYER_PREFIXES = ("midlayer.", "layers.0.")


def aux_layer_ids(head: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: its config's, else EAGLE-3's default."""
    ids = head.option("aux_layer_ids")
    if ids is None:
        num_layers = target.num_layers
        ids = (2, num_layers // 2, num_layers - 3)
    if any(not 0 <= i < target.num_layers for i in ids):
        raise ValueError(
            f"the EAGLE-3 head reads the target's layers {tuple(ids)}, but the target has "
            f"{target.num_layers} layers"
        )
    return tuple(ids)


class Eagle3Head(nnx.Module):
    is_draft_head = True  # speculative_config's model, never an engine's own (registry.py)
    # The target layers whose inputs it reads (worker/eagle.py).
    target_layer_ids = staticmethod(aux_layer_ids)

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        check_one_layer(cfg, "an EAGLE-3 head")
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError(
                "an EAGLE-3 head with eagle_config.use_aux_hidden_state=False is not supported; "
                "it reads three of the target's layers"
            )
        cfg["hidden_act"] = check_activation(cfg.get("hidden_act", "silu"), "hidden_act")
        options = {
            "draft_vocab_size": cfg.get("draft_vocab_size") or cfg["vocab_size"],
            "target_hidden_size": cfg.get("target_hidden_size") or cfg["hidden_size"],
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        }
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            options["aux_layer_ids"] = tuple(int(i) for i in ids)
        cfg["options"] = {**cfg.get("options", {}), **options}
        cfg["sliding_window"] = None
        return cfg

    def __init__(self, config: ModelConfig):
        d, dtype = config.hidden_size, jnp.dtype(config.dtype)
        self.config = config
        # One device's share of the draft vocabulary under tensor parallelism (the last one's
        # padded), as shard_config cuts the target's.
        draft_vocab = -(-config.option("draft_vocab_size") // config.num_shards)
        self.fc = Linear(
            3 * config.option("target_hidden_size"), d, ("embed", "embed"), dtype=dtype
        )
        self.input_norm = RMSNorm(d, config.rms_norm_eps)  # over the token's embedding
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)  # over the hidden row
        self.attn = Attention(config, input_size=2 * d)
        self.post_attention_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = Linear(d, draft_vocab, ("vocab", "embed"), dtype=dtype)
        self.d2t = param((draft_vocab,), jnp.int32, ("vocab",))  # target id - draft id

    def combine(self, rows: jax.Array) -> jax.Array:
        """The target's captured layer inputs f32[3, T, D_t] -> the head's hidden rows f32[T, D]."""
        num, num_tokens, width = rows.shape
        return self.fc(jnp.moveaxis(rows, 0, 1).reshape(num_tokens, num * width))

    def __call__(
        self, kv_cache, embeds, hidden, positions, metadata, attn: AttentionFn
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The next tokens' embeddings f32[T, D] and hidden rows f32[T, D] at `positions`
        i32[T] -> (normed f32[T, D] for the LM head, pre-norm f32[T, D] for the next draft
        step, kv_cache)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.config.option("norm_before_residual") else hidden
        x = jnp.concatenate([self.input_norm(embeds), normed], axis=-1)  # [T, 2D]
        cos, sin = rope_cos_sin(positions, self.config)
        out, kv_cache = self.attn(x, jnp.int32(0), cos, sin, kv_cache, metadata, attn)
        residual = residual + out
        prenorm = residual + self.mlp(self.post_attention_norm(residual))
        return self.final_norm(prenorm), prenorm, kv_cache

    def draft_logits(self, normed: jax.Array, vocab_size: int) -> jax.Array:
        """normed f32[S, D] -> f32[S, V] logits over the target's `vocab_size` ids: the draft
        vocabulary's at their target ids (d2t), -inf at the others (a draft vocabulary padded
        to cut over T devices keeps its padding out). On one device of several inside a
        shard_map (a group of ranks' step) its share of the LM head and d2t is gathered."""
        draft_vocab_size = self.config.option("draft_vocab_size")
        num_shards = self.config.num_shards
        logits = gather_over_shards(self.lm_head(normed), num_shards, axis=1)
        logits = logits[:, :draft_vocab_size].astype(jnp.float32)
        d2t = gather_over_shards(self.d2t[...], num_shards, axis=0)[:draft_vocab_size]
        target_ids = jnp.arange(draft_vocab_size) + d2t
        placed = jnp.full((normed.shape[0], vocab_size), -jnp.inf, jnp.float32)
        return placed.at[:, target_ids].set(logits)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """A checkpoint without `d2t` drafts over the target's whole vocabulary (offsets 0)."""
        prefix = next((p for p in _LAYER_PREFIXES if weights.has(p + "hidden_norm.weight")), None)
        if prefix is None:
            raise ValueError(
                "the EAGLE-3 checkpoint has no midlayer.hidden_norm.weight (nor "
                "layers.0.hidden_norm.weight): not an EAGLE-3 head"
            )
        weights.tensor("fc.weight", "fc.weight")
        for path, name in (
            ("input_norm.weight", "input_layernorm.weight"),
            ("hidden_norm.weight", "hidden_norm.weight"),
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("attn.o.weight", "self_attn.o_proj.weight"),
            ("mlp.down.weight", "mlp.down_proj.weight"),
        ):
            weights.tensor(path, prefix + name)
        qkv = [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
        gate_up = [prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up")]
        weights.concatenated("attn.qkv.weight", qkv)
        weights.concatenated("mlp.gate_up.weight", gate_up)
        weights.tensor("final_norm.weight", "norm.weight")
        weights.tensor("lm_head.weight", "lm_head.weight")
        if weights.has("d2t"):
            weights.tensor("d2t", "d2t")
        else:
            weights.value("d2t", np.zeros((), np.int32))
