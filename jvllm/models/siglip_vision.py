"""SigLIP's vision transformer (Idefics3's, SmolVLM's and Gemma 3's image encoder) as flax.nnx
modules: square images of `image_size` pixels -> the last layer's normed hidden states, one
row a patch (no class token). Letters as in vit.py; P patches an image, N images or tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


class SiglipVisionTower(nnx.Module):
    def __init__(self, vision: VisionSettings, dtype):
        c, p = vision.hidden_size, vision.patch_size
        self.vision = vision
        self.patch = param((c, 3 * p * p), dtype, ("embed", "embed"))  # the conv's [C, 3, p, p]
        self.patch_bias = param((c,), jnp.float32, ("embed",))
        self.positions = param((vision.num_patches, c), jnp.float32, ("positions", "embed"))
        self.layers = stacked_layers(lambda: ViTLayer(vision, dtype), vision.num_layers)
        self.post_norm = LayerNorm(c, vision.layer_norm_eps)

    def __call__(self, pixel_values: jax.Array, pixel_mask: jax.Array | None = None) -> jax.Array:
        """pixel_values f32[N, 3, S, S] -> f32[N, P, C]. `pixel_mask` bool[N, S, S] marks a
        padded image's real pixels (None: every pixel is): its patches with any real pixel
        attend and take positions spread over the whole table, as HF's Idefics3 places a
        smaller image (NaViT's fractional positions)."""
        x = patch_embeddings(pixel_values, self.patch[...], self.vision.patch_size)  # [N, P, C]
        x = x + self.patch_bias[...]
        if pixel_mask is None:
            x = x + self.positions[...]
            key_mask = None
        else:
            patch_mask = self._patch_mask(pixel_mask)  # [N, g, g]
            x = x + self.positions[...][_fractional_positions(patch_mask)]
            key_mask = patch_mask.reshape(x.shape[0], -1)
        x = scan_layers(self.layers, lambda layer, x, i, _: layer(x, key_mask), x)
        return self.post_norm(x)

    def _patch_mask(self, pixel_mask: jax.Array) -> jax.Array:
        """bool[N, S, S] -> bool[N, g, g]: the patches holding any real pixel."""
        n, size, _ = pixel_mask.shape
        p = self.vision.patch_size
        g = size // p
        return pixel_mask.reshape(n, g, p, g, p).any(axis=(2, 4))

    @staticmethod
    def load_weights(weights: CheckpointWeights, path: str, prefix: str, num_layers: int) -> None:
        """The tower's params (under `path`) from HF's SigLIP / Idefics3 vision tensors under
        `prefix` (e.g. "model.vision_model.")."""
        weights.tensor(f"{path}.patch", prefix + "embeddings.patch_embedding.weight", flatten_conv)
        weights.tensor(f"{path}.patch_bias", prefix + "embeddings.patch_embedding.bias")
        weights.tensor(f"{path}.positions", prefix + "embeddings.position_embedding.weight")
        weights.tensor(f"{path}.post_norm.weight", prefix + "post_layernorm.weight")
        weights.tensor(f"{path}.post_norm.bias", prefix + "post_layernorm.bias")
        load_vit_layers(weights, path, prefix, num_layers)


def _fractional_positions(patch_mask: jax.Array) -> jax.Array:
    """bool[N, g, g] -> i32[N, g * g]: each real patch's row of the g x g position table, its
    row and column scaled from the image's own patch counts to g, in HF's float32 arithmetic
    (bucketize over k / g); 0 for padding patches."""
    g = patch_mask.shape[1]
    # torch.arange(1 / g, 1.0, 1 / g): each bound computed in float64, then stored as float32.
    bounds = jnp.asarray((np.arange(1, g) * (1.0 / g)).astype(np.float32))
    rows = patch_mask[:, :, 0].sum(axis=1).astype(jnp.float32)  # [N] the image's patch rows
    cols = patch_mask[:, 0, :].sum(axis=1).astype(jnp.float32)
    index = jnp.arange(g, dtype=jnp.float32)
    limit = np.float32(1.0 - 1e-6)
    frac_h = jnp.minimum(index[None, :] * (1.0 / rows)[:, None], limit)  # [N, g]
    frac_w = jnp.minimum(index[None, :] * (1.0 / cols)[:, None], limit)
    bucket_h = jnp.searchsorted(bounds, frac_h, side="right")
    bucket_w = jnp.searchsorted(bounds, frac_w, side="right")
    ids = (bucket_h[:, :, None] * g + bucket_w[:, None, :]).reshape(patch_mask.shape[0], -1)
    return jnp.where(patch_mask.reshape(ids.shape), ids, 0)
