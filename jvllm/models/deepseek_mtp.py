"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (speculative decoding's
"mtp" method; vLLM's DeepSeekMTPModel), read from the target's own checkpoint.

The checkpoint keeps it after the target's L layers, under model.layers.{L}.: `enorm` and
`hnorm` (RMSNorms), `eh_proj` [D, 2D], a decoder layer as the target's (MLA, and the experts
as the target's MoE layers: models/deepseek.py), and `shared_head.norm` / `shared_head.head`
(its LM head); the token embedding is the target's. Its row at position j reads the embedding
of the token AT j + 1 and a hidden row at j:

    row = layer(eh_proj([enorm(embed(t[j + 1])), hnorm(h[j])]))  (the residual stream out)
    draft = argmax(shared_head.head(shared_head.norm(row)))

For the first draft h is the target's final hidden state, post final norm (what vLLM passes:
DeepseekV2Model returns it normed; HF's last_hidden_state is the same row); for the next draft
steps it is the layer's own pre-norm row, as vLLM chains one layer k times (HF's MtpModel,
transformers 5, chains the post-norm row instead). vLLM also zeroes the embedding at position
0, a leftover of its older shifted positions; jvllm does not, and only drafts could differ.

The config is the target's config.json read as DeepSeek-V3's (its MLA and routing settings)
with one layer; `options["mtp_layer"]` is the checkpoint's index L. GLM-4.5's MTP layer is the
same head over its own family's layer (models/glm4_moe_mtp.py). The engine side is
worker/eagle.py, as for an EAGLE-3 head, with the target's final rows in place of its layers'
inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.layers.attention import AttentionFn
from jvllm.layers.linear import Linear
from jvllm.layers.norm import RMSNorm
from jvllm.layers.parallel import gather_over_shards
from jvllm.layers.rotary_layers import run_rotary_layers
from jvllm.layers.scan import stacked_layers
from jvllm.models.deepseek import DeepseekDecoderLayer, load_layers, rotary_config
from jvllm.models.registry import model_class
from jvllm.models.weights import CheckpointWeights


class DeepseekMTPHead(nnx.Module):
    is_draft_head = True  # speculative_config's drafter, never an engine's own (registry.py)

    # The target family the head reads its config as, what the config.json's model_type must
    # be, and the head's layer; a head for another family (GLM-4.5's, models/glm4_moe_mtp.py)
    # sets its own, with `rotary_config` and `load_layer`.
    target_architecture = "DeepseekV3ForCausalLM"
    target_model_types = ("deepseek_v3",)
    decoder_layer = DeepseekDecoderLayer

    @classmethod
    def normalize_hf_config(cls, cfg: dict) -> dict:
        """The target's config.json (its `architectures` replaced by this head's) -> the
        head's: the target family's reading of it with the MTP layer counted as layer L, so that
        it is an MoE layer exactly where HF's numbering makes it one."""
        if cfg.get("model_type") not in cls.target_model_types:
            raise ValueError(
                f"speculative_config method 'mtp' reads a {cls.target_architecture} "
                f"checkpoint's MTP layer; this config.json has model_type "
                f"{cfg.get('model_type')!r}"
            )
        if not cfg.get("num_nextn_predict_layers"):
            raise ValueError(
                "speculative_config method 'mtp' needs a checkpoint with multi-token-prediction "
                "layers, but its config.json has num_nextn_predict_layers="
                f"{cfg.get('num_nextn_predict_layers')!r}"
            )
        mtp_layer = cfg["num_hidden_layers"]
        cfg = {
            **cfg,
            "architectures": [cls.target_architecture],
            "num_hidden_layers": mtp_layer + 1,
        }
        cfg = model_class(cls.target_architecture).normalize_hf_config(cfg)
        is_moe = cfg["first_k_dense_replace"] <= mtp_layer
        cfg["num_hidden_layers"] = 1
        options = {k: v for k, v in cfg["options"].items() if k != "num_dense_layers"}
        cfg["options"] = {**options, "mtp_layer": mtp_layer, "is_moe": is_moe}
        return cfg

    @staticmethod
    def rotary_config(config: ModelConfig) -> ModelConfig:
        """The config the layer's rotary (cos, sin) are computed from."""
        return rotary_config(config)

    @staticmethod
    def load_layer(config: ModelConfig, weights: CheckpointWeights, is_moe: bool) -> None:
        """The layer's params, from the layer weights.set_layers names."""
        load_layers(config, weights, "layers.", is_moe=is_moe)

    @staticmethod
    def target_layer_ids(head: ModelConfig, target: ModelConfig) -> None:
        """None: it reads the target's final hidden states, no layer's input (eagle3.py's do)."""
        return

    @staticmethod
    def is_read_elsewhere(config: ModelConfig, name: str) -> bool:
        """Whether the checkpoint's tensor `name` is the target's (not the MTP layer's)."""
        return not name.startswith(f"model.layers.{config.option('mtp_layer')}.")

    def __init__(self, config: ModelConfig):
        d, dtype = config.hidden_size, jnp.dtype(config.dtype)
        self.config = config
        self.enorm = RMSNorm(d, config.rms_norm_eps)  # over the next token's embedding
        self.hnorm = RMSNorm(d, config.rms_norm_eps)  # over the hidden row
        self.eh_proj = Linear(2 * d, d, ("embed", "embed"), dtype=dtype)
        is_moe = config.option("is_moe")
        self.layers = stacked_layers(lambda: self.decoder_layer(config, is_moe), 1)
        self.shared_norm = RMSNorm(d, config.rms_norm_eps)
        self.shared_head = Linear(d, config.vocab_size, ("vocab", "embed"), dtype=dtype)

    def combine(self, rows: jax.Array) -> jax.Array:
        """The target's final hidden rows f32[T, D] are the hidden rows as they are."""
        return rows

    def __call__(
        self, kv_cache, embeds, hidden, positions, metadata, attn: AttentionFn
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The next tokens' embeddings f32[T, D] and hidden rows f32[T, D] at `positions`
        i32[T] -> (normed f32[T, D] for the LM head, pre-norm f32[T, D] for the next draft
        step, kv_cache)."""
        x = jnp.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1)  # [T, 2D]
        x = self.eh_proj(x)
        rotary = self.rotary_config(self.config)
        args = (self.layers, x, kv_cache, positions, rotary, metadata, attn)
        x, kv_cache = run_rotary_layers(*args)
        return self.shared_norm(x), x, kv_cache

    def draft_logits(self, normed: jax.Array, vocab_size: int) -> jax.Array:
        """normed f32[S, D] -> f32[S, V] logits over the target's `vocab_size` ids (on one
        device of several inside a shard_map, its share of them gathered)."""
        logits = gather_over_shards(self.shared_head(normed), self.config.num_shards, axis=1)
        return logits[:, :vocab_size].astype(jnp.float32)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        """The MTP layer's tensors (the first, where the checkpoint keeps more)."""
        index = config.option("mtp_layer")
        prefix = f"model.layers.{index}."
        if not weights.has(prefix + "eh_proj.weight"):
            raise ValueError(
                "speculative_config method 'mtp': the checkpoint has no MTP layer tensors "
                f"({prefix}eh_proj.weight, ...) though its config.json has "
                "num_nextn_predict_layers; it was saved without them (as HF's "
                "DeepseekV3ForCausalLM saves)"
            )
        for path, name in (
            ("enorm.weight", "enorm.weight"),
            ("hnorm.weight", "hnorm.weight"),
            ("eh_proj.weight", "eh_proj.weight"),
            ("shared_norm.weight", "shared_head.norm.weight"),
            ("shared_head.weight", "shared_head.head.weight"),
        ):
            weights.tensor(path, prefix + name)
        weights.set_layers(index, 1)
        cls.load_layer(config, weights, config.option("is_moe"))
