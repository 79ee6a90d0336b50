"""Qwen3-VL (Qwen3VLForConditionalGeneration), images only: Qwen2-VL's design
(models/qwen2_vl.py: M-RoPE positions, the runner encoding each image once) with Qwen3-VL's
tower (models/qwen3_vl_vision.py), a Qwen3 language model (q/k norms), M-RoPE whose rotary pairs
take the temporal, height and width streams in turn (interleaved, rotary.mrope_cos_sin), and
DeepStack: the tower's features of its intermediate blocks are added to the image tokens'
hidden rows after the language model's first layers, one level a layer.

An image token's row in the step (layers/image_embeds.py) holds its embedding then its K2
DeepStack features: (1 + K2) * D wide (the option image_embed_width).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.qwen2_vl import Generation, Qwen2VLForConditionalGeneration, normalize_vl
from jvllm.models.qwen3_moe import Qwen3MoeForCausalLM
from jvllm.models.qwen3_vl_vision import Qwen3VisionTower, qwen3_vision_settings
from jvllm.models.weights import CheckpointWeights

QWEN3_VL = Generation(
    # Qwen3VLTextConfig's defaults.
    text_defaults={
        "num_key_value_heads": 32,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 128000,
    },
    rope_theta=500_000.0,
    mrope_section=(24, 20, 20),
    text_model_type="qwen3",
    text_architecture="Qwen3ForCausalLM",
    text_normalize=LlamaForCausalLM.normalize_hf_config,
    keeps_head_dim=True,
    max_pixels=16_777_216,  # the processor's longest_edge: 16384 merged patches of 32 x 32
    vision=lambda vc, architecture: qwen3_vision_settings(vc),
)


QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    # Qwen3VLMoeTextConfig's defaults.
    text_defaults={
        **QWEN3_VL.text_defaults,
        "head_dim": None,  # hidden_size / heads
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
    },
    text_model_type="qwen3_moe",
    text_architecture="Qwen3MoeForCausalLM",
    text_normalize=lambda cfg: Qwen3MoeForCausalLM.normalize_hf_config(
        {**cfg, "norm_topk_prob": True}  # HF's router always renormalises
    ),
)


def _normalize(cfg: dict, generation: Generation = QWEN3_VL) -> dict:
    cfg = normalize_vl(cfg, generation)
    num_levels = len(cfg["options"]["vision"].deepstack_layers)
    if num_levels > cfg["num_hidden_layers"]:
        raise ValueError(
            f"vision_config.deepstack_visual_indexes names {num_levels} levels, more than the "
            f"language model's {cfg['num_hidden_layers']} layers that take them"
        )
    cfg["options"] = {
        **cfg["options"],
        "deepstack_levels": num_levels,
        "image_embed_width": (1 + num_levels) * cfg["hidden_size"],
    }
    return cfg


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    normalize_hf_config = staticmethod(_normalize)
    mrope_interleaved = True
    tower = Qwen3VisionTower

    def after_layer(self, mm):
        """DeepStack: after layer i < K2, each image token's row plus its level-i feature
        (mm.embeds f32[T, (1 + K2) * D], the level's D columns)."""
        num_levels, d = self.config.option("deepstack_levels"), self.config.hidden_size
        if not num_levels:
            return None
        features = mm.embeds[:, d:].reshape(-1, num_levels, d)  # [T, K2, D]

        def add(x, layer):  # x f32[T, D], layer i32[]
            level = jnp.minimum(layer, num_levels - 1)
            feature = jax.lax.dynamic_index_in_dim(features, level, axis=1, keepdims=False)
            is_added = mm.is_embed[:, None] & (layer < num_levels)
            return jnp.where(is_added, x + feature.astype(x.dtype), x)

        return add


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-30B-A3B, 235B-A22B: Qwen3-VL with a Qwen3-MoE text model, whose checkpoints
    keep each layer's experts fused: gate_up_proj [E, D, 2F] (gate | up) and down_proj
    [E, F, D] as released, or transposed ([E, 2F, D], [E, D, F]) as transformers 5 saves
    them; the shape tells which (where D = 2F or D = F, the released layout is assumed)."""

    normalize_hf_config = staticmethod(lambda cfg: _normalize(cfg, QWEN3_VL_MOE))

    @staticmethod
    def load_mlp_weights(config: ModelConfig, weights: CheckpointWeights) -> None:
        d, f = config.hidden_size, config.moe_intermediate_size
        weights.stacked("layers.mlp.router", ("mlp.gate.weight",))
        for path, name, shape in (
            ("gate_up", "gate_up_proj", (d, 2 * f)),
            ("down", "down_proj", (f, d)),
        ):
            transform = lambda w, shape=shape: w if w.shape[1:] == shape else w.transpose(0, 2, 1)
            weights.stacked(f"layers.mlp.{path}", (f"mlp.experts.{name}",), transform)
