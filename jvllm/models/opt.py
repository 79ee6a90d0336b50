"""OPT (OPTForCausalLM) as flax.nnx modules: learned positions read 2 rows into their table,
LayerNorm layers (layers/layer_norm_decoder.py) pre-norm (125m and most sizes) or post-norm
(350m), a final LayerNorm in pre-norm models, and, where the token embedding is narrower than the
layers (350m: E 512, D 1024), projections in from and out to it. The LM head is tied to the token
embedding unless the config unties it.

HF scales q by head_dim**-0.5 right after q_proj and attends unscaled; attention here applies the
same factor to q . k, which is the same product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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

# Position p reads row p + 2 of OPT's table, which has max_position_embeddings + 2 rows.
_POSITION_OFFSET = 2
# OPT's LayerNorms are torch's default; its config has no field for their epsilon.
_LAYER_NORM_EPS = 1e-5


class OPTForCausalLM(nnx.Module):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        hidden_size, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        is_pre_norm = cfg.get("do_layer_norm_before", True)
        cfg.update(
            num_key_value_heads=num_heads,
            head_dim=hidden_size // num_heads,
            intermediate_size=cfg["ffn_dim"],
            rms_norm_eps=_LAYER_NORM_EPS,
            hidden_act=check_activation(
                cfg.get("activation_function", "relu"), "activation_function"
            ),
            attention_bias=cfg.get("enable_bias", True),
            options={
                "do_layer_norm_before": is_pre_norm,
                # Post-norm models end on a layer's norm; _remove_final_layer_norm drops the
                # final norm of checkpoints fine-tuned before transformers 4.20.1.
                "has_final_norm": is_pre_norm and not cfg.get("_remove_final_layer_norm", False),
                "layer_norm_elementwise_affine": cfg.get("layer_norm_elementwise_affine", True),
                "word_embed_proj_dim": cfg.get("word_embed_proj_dim") or hidden_size,  # E
            },
        )
        cfg.setdefault("tie_word_embeddings", True)
        return cfg

    def __init__(self, config: ModelConfig):
        dtype = jnp.dtype(config.dtype)
        d, e = config.hidden_size, config.option("word_embed_proj_dim")
        is_affine = config.option("layer_norm_elementwise_affine")
        self.embed = Embed(config.vocab_size, e, dtype=dtype, num_shards=config.num_shards)
        self.positions = PositionEmbed(
            config.max_position_embeddings, d, dtype=dtype, offset=_POSITION_OFFSET
        )
        # E and D are both widths of the embedding, one before and one after the projection.
        self.project_in = Linear(e, d, ("embed", "embed"), dtype=dtype) if e != d else None
        self.layers = stacked_layers(
            lambda: LayerNormDecoderLayer(
                config,
                is_pre_norm=config.option("do_layer_norm_before"),
                is_norm_affine=is_affine,
            ),
            config.num_layers,
        )
        self.final_norm = (
            LayerNorm(d, config.rms_norm_eps, is_affine=is_affine)
            if config.option("has_final_norm")
            else None
        )
        self.project_out = Linear(d, e, ("embed", "embed"), dtype=dtype) if e != d else None
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(e, config.vocab_size, ("vocab", "embed"), dtype=dtype)
        )

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn):
        """token_ids i32[T], positions i32[T] -> (post-norm hidden f32[T, D], kv_cache)."""
        x = self.embed(token_ids)  # [T, E]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, D]
        x = x + self.positions(positions)

        def body(layer_module, carry, layer, _):
            x, kv_cache = carry
            return layer_module(x, layer, kv_cache, metadata, attn)

        x, kv_cache = scan_layers(self.layers, body, (x, kv_cache))
        return (x if self.final_norm is None else self.final_norm(x)), kv_cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden f32[S, D] (already final-normed) -> logits f32[S, V]. The projection out to E
        runs here, on the rows that sample, so that the hidden states keep the contract's D."""
        if self.project_out is not None:
            hidden = self.project_out(hidden)  # [S, E]
        if self.lm_head is None:
            return self.embed.attend(hidden)
        return self.lm_head(hidden)

    @staticmethod
    def load_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        """The HF checkpoint's tensors into this module's params. OPTForCausalLM saves them
        under "model.decoder."; the original checkpoints (facebook/opt-*) under "decoder."."""
        prefix = (
            "model.decoder." if weights.has("model.decoder.embed_tokens.weight") else "decoder."
        )
        weights.set_layer_prefix(prefix + "layers.{}.")
        is_affine = config.option("layer_norm_elementwise_affine")
        kinds = ("weight", "bias") if config.attention_bias else ("weight",)
        weights.tensor("embed.embedding", prefix + "embed_tokens.weight")
        weights.tensor("positions.embedding", prefix + "embed_positions.weight")
        for kind in kinds:
            qkv = tuple(f"self_attn.{n}_proj.{kind}" for n in "qkv")
            weights.stacked(f"layers.attn.qkv.{kind}", qkv)
            weights.stacked(f"layers.attn.o.{kind}", (f"self_attn.out_proj.{kind}",))
            weights.stacked(f"layers.mlp.up.{kind}", (f"fc1.{kind}",))
            weights.stacked(f"layers.mlp.down.{kind}", (f"fc2.{kind}",))
        for kind in ("weight", "bias") if is_affine else ():
            weights.stacked(f"layers.attn_norm.{kind}", (f"self_attn_layer_norm.{kind}",))
            weights.stacked(f"layers.mlp_norm.{kind}", (f"final_layer_norm.{kind}",))
            if config.option("has_final_norm"):
                weights.tensor(f"final_norm.{kind}", f"{prefix}final_layer_norm.{kind}")
        if config.option("word_embed_proj_dim") != config.hidden_size:
            weights.tensor("project_in.weight", prefix + "project_in.weight")
            weights.tensor("project_out.weight", prefix + "project_out.weight")
        if not config.tie_word_embeddings:
            weights.tensor("lm_head.weight", "lm_head.weight")
