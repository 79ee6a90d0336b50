"""CLIP's vision transformer (LLaVA's image encoder) as flax.nnx modules: patches -> the hidden
states of a chosen layer. Not a registered family: the multimodal families hold one.

Letters as in vit.py; P patches an image (plus one class token: Q = P + 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.norm import LayerNorm
from jvllm.layers.params import param
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.vit import (
    VisionSettings,
    ViTLayer,
    flatten_conv,
    load_vit_layers,
    patch_embeddings,
)
from jvllm.models.weights import CheckpointWeights


class CLIPVisionTower(nnx.Module):
    def __init__(self, vision: VisionSettings, dtype):
        c, p = vision.hidden_size, vision.patch_size
        self.vision = vision
        self.patch = param((c, 3 * p * p), dtype, ("embed", "embed"))  # the conv's [C, 3, p, p]
        self.class_embedding = param((c,), jnp.float32, ("embed",))
        self.positions = param((vision.num_patches + 1, c), jnp.float32, ("positions", "embed"))
        self.pre_norm = LayerNorm(c, vision.layer_norm_eps)
        self.layers = stacked_layers(lambda: ViTLayer(vision, dtype), vision.num_layers)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[N, 3, S, S] -> the chosen layer's hidden states f32[N, Q, C]
        (class token first)."""
        x = patch_embeddings(pixel_values, self.patch[...], self.vision.patch_size)  # [N, P, C]
        n = x.shape[0]
        cls = jnp.broadcast_to(self.class_embedding[...], (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.positions[...]  # [N, Q, C]
        x = self.pre_norm(x)
        return scan_layers(self.layers, lambda layer, x, i, _: layer(x), x)

    @staticmethod
    def load_weights(weights: CheckpointWeights, path: str, prefix: str, num_layers: int) -> None:
        """The tower's params (under `path`, e.g. "vision") from HF's CLIPVisionModel tensors
        under `prefix` ("vision_tower.vision_model." or "vision_tower.")."""
        weights.tensor(f"{path}.patch", prefix + "embeddings.patch_embedding.weight", flatten_conv)
        weights.tensor(f"{path}.class_embedding", prefix + "embeddings.class_embedding")
        weights.tensor(f"{path}.positions", prefix + "embeddings.position_embedding.weight")
        weights.tensor(f"{path}.pre_norm.weight", prefix + "pre_layrnorm.weight")
        weights.tensor(f"{path}.pre_norm.bias", prefix + "pre_layrnorm.bias")
        load_vit_layers(weights, path, prefix, num_layers)
