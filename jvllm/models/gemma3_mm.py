"""Gemma 3 with images (Gemma3ForConditionalGeneration, 4B and up): a SigLIP tower, its patches
average-pooled to mm_tokens_per_image, RMS-normed and projected into the Gemma 3 text model,
whose image tokens attend to their whole image (attention/image_ahead.py), as HF's do.

A prompt marks each image with <start_of_image>; the processor writes the image's tokens
between that marker and <end_of_image>, with blank lines around them. A config without a
vision_config runs its text model alone, and takes no images.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import transformers

from jvllm.config import ModelConfig
from jvllm.layers.linear import Linear
from jvllm.layers.norm import RMSNorm
from jvllm.models.gemma import GemmaForCausalLM
from jvllm.models.siglip_vision import SiglipVisionTower
from jvllm.models.vit import vision_settings
from jvllm.models.weights import CheckpointWeights


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or cfg)
        text["architectures"] = ["Gemma3ForConditionalGeneration"]
        # What the outer config says of the whole model holds for its text part too.
        for name in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if cfg.get(name) is not None:
                text[name] = cfg[name]
        text = GemmaForCausalLM.normalize_hf_config(text)
        if not cfg.get("vision_config"):
            return text
        vision_config = {**transformers.SiglipVisionConfig().to_dict(), **cfg["vision_config"]}
        vision = vision_settings(vision_config, -1)
        num_tokens = cfg.get("mm_tokens_per_image", 256)
        side, tokens_side = vision.image_size // vision.patch_size, math.isqrt(num_tokens)
        if tokens_side**2 != num_tokens or side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image={num_tokens} must be a square whose side divides the "
                f"tower's {side} patches a side"
            )
        text["options"] = {
            **text.get("options", {}),
            "vision": vision,
            "image_token_id": cfg.get("image_token_index", 262144),
            "image_placeholder_id": cfg.get("boi_token_index", 255999),
            "mm_tokens_per_image": num_tokens,
            "bidirectional_images": True,
        }
        return text

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        vision = config.option("vision")
        if vision is None:
            return
        dtype = jnp.dtype(config.dtype)
        self.vision = SiglipVisionTower(vision, dtype)
        self.soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, weight_offset=1.0)
        self.projection = Linear(
            vision.hidden_size, config.hidden_size, ("embed", "embed"), dtype=dtype
        )

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[N, 3, S, S] -> each image's embeddings f32[N, I, D], I =
        mm_tokens_per_image: the tower's g x g patches averaged in (g / t) x (g / t) squares
        into t x t, row by row."""
        features = self.vision(pixel_values)  # [N, g*g, C]
        n, p, c = features.shape
        g, t = math.isqrt(p), math.isqrt(self.config.option("mm_tokens_per_image"))
        pooled = features.reshape(n, t, g // t, t, g // t, c).mean(axis=(2, 4))
        return self.projection(self.soft_emb_norm(pooled.reshape(n, t * t, c)))

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        return config.option("mm_tokens_per_image")

    @staticmethod
    def load_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        # Saved by transformers 4 (and by 5, which converts back on save) under
        # "language_model.model."; transformers 5's own modules name them "model.language_model.".
        if weights.has("language_model.model.norm.weight"):
            text, outer = "language_model.model.", ""
        else:
            text, outer = "model.language_model.", "model."
        GemmaForCausalLM.load_weights(config, weights, prefix=text)
        vision = config.option("vision")
        if vision is None:
            return
        tower = outer + "vision_tower."
        if weights.has(tower + "vision_model.post_layernorm.weight"):
            tower += "vision_model."
        SiglipVisionTower.load_weights(weights, "vision", tower, vision.num_layers)
        projector = outer + "multi_modal_projector."
        weights.tensor("soft_emb_norm.weight", projector + "mm_soft_emb_norm.weight")
        weights.tensor("projection.weight", projector + "mm_input_projection_weight", lambda w: w.T)
