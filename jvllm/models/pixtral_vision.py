"""Pixtral's vision transformer (HF's PixtralVisionModel, the tower of Mistral 3 and Pixtral) as
flax.nnx modules: an image at its own resolution, as patches in raster order -> each patch's
features. Not a registered family: models/mistral3.py holds one.

The tower runs a batch of images padded to one number of patches P: a padding patch has segment
-1, which no real patch attends to (qwen2_vl_vision.segment_attention), so each image attends
to itself alone, as HF's block-diagonal mask makes it. Each patch turns by its (row, column)
with Pixtral's axial rotary embedding: the head's even frequencies by the row, its odd ones by
the column, in rotate-half layout.

Letters: N images, P patches an image, K a patch's values (3 * p * p), C the tower's width, F its
MLP width, M its heads, E a head's width (C / M).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.layers.activation import ACTIVATIONS, check_activation
from jvllm.layers.linear import Linear
from jvllm.layers.norm import RMSNorm
from jvllm.layers.params import param
from jvllm.layers.rotary import apply_rope
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.qwen2_vl_vision import segment_attention
from jvllm.models.vit import flatten_conv
from jvllm.models.weights import CheckpointWeights

_NORM_EPS = 1e-5  # HF's, fixed for ln_pre and the blocks' norms


@dataclasses.dataclass(frozen=True)
class PixtralSettings:
    """The tower's shape, read from a checkpoint's vision_config (hashable: it travels in
    ModelConfig.options)."""

    hidden_size: int  # C
    intermediate_size: int  # F
    num_heads: int  # M
    num_layers: int  # the blocks run: up to the feature layer the model reads
    patch_size: int
    in_channels: int
    image_size: int  # the longest side, in pixels, the image processor resizes to
    hidden_act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:  # E
        return self.hidden_size // self.num_heads


def pixtral_settings(vision_config: dict, feature_layer: int) -> PixtralSettings:
    """The tower of a PixtralVisionConfig dict, run up to hidden state `feature_layer` (HF's
    vision_feature_layer: -1 the last block's output, k > 0 block k - 1's; 0, the patches
    before any block, is refused), with PixtralVisionConfig's defaults and errors naming the
    field."""
    vc = vision_config
    num_layers = vc.get("num_hidden_layers", 24)
    if isinstance(feature_layer, bool) or not isinstance(feature_layer, int):
        raise TypeError(f"vision_feature_layer must be an int, got {feature_layer!r}")
    run = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 < run <= num_layers:
        raise ValueError(
            f"vision_feature_layer={feature_layer} names no block of the {num_layers}-block tower"
        )
    settings = PixtralSettings(
        hidden_size=vc.get("hidden_size", 1024),
        intermediate_size=vc.get("intermediate_size", 4096),
        num_heads=vc.get("num_attention_heads", 16),
        num_layers=run,
        patch_size=vc.get("patch_size", 16),
        in_channels=vc.get("num_channels", 3),
        image_size=vc.get("image_size", 1024),
        hidden_act=check_activation(vc.get("hidden_act", "gelu"), "vision_config.hidden_act"),
        rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    )
    head_dim = vc.get("head_dim") or settings.head_dim
    if head_dim != settings.head_dim or head_dim % 4:
        raise ValueError(
            f"vision_config.head_dim={head_dim} must be hidden_size / num_attention_heads and a "
            "multiple of 4 (2-D rotary embeddings)"
        )
    return settings


def image_patches(vision: PixtralSettings, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """One image's pixels f32[3, H, W] (sides multiples of the patch) -> "patches" f32[P, K] in
    raster order, each (channel, row, column) as the patch convolution reads it, and
    "positions" i32[P, 2], each patch's (row, column)."""
    c, height, width = pixels.shape
    p = vision.patch_size
    h, w = height // p, width // p
    patches = pixels[:, : h * p, : w * p].reshape(c, h, p, w, p).transpose(1, 3, 0, 2, 4)
    positions = np.indices((h, w)).reshape(2, -1).T
    return {
        "patches": patches.reshape(h * w, c * p * p).astype(np.float32),
        "positions": positions.astype(np.int32),
    }


def _rope_cos_sin(positions: jax.Array, vision: PixtralSettings):
    """positions i32[T, 2] (row, column) -> (cos, sin) f32[T, E]: E/2 frequencies of the
    head, the even ones turned by the row, the odd ones by the column, twice (rotate-half)."""
    e = vision.head_dim
    exponents = np.arange(0, e, 2, dtype=np.float32) / np.float32(e)
    inv_freq = 1.0 / (np.float32(vision.rope_theta) ** exponents)  # [E/2]
    rows = positions[:, :1].astype(jnp.float32) * jnp.asarray(inv_freq[0::2])  # [T, E/4]
    cols = positions[:, 1:].astype(jnp.float32) * jnp.asarray(inv_freq[1::2])  # [T, E/4]
    angles = jnp.concatenate([rows, cols, rows, cols], axis=-1)  # [T, E]
    return jnp.cos(angles), jnp.sin(angles)


class PixtralBlock(nnx.Module):
    def __init__(self, vision: PixtralSettings, dtype):
        c, f = vision.hidden_size, vision.intermediate_size
        self.num_heads = vision.num_heads
        self.act = ACTIVATIONS[vision.hidden_act]
        self.attention_norm = RMSNorm(c, _NORM_EPS)
        self.qkv = Linear(c, 3 * c, ("embed", "embed"), dtype=dtype)
        self.o = Linear(c, c, ("embed", "embed"), dtype=dtype)
        self.ffn_norm = RMSNorm(c, _NORM_EPS)
        self.gate_up = Linear(c, 2 * f, ("embed", "embed"), dtype=dtype)
        self.down = Linear(f, c, ("embed", "embed"), dtype=dtype)

    def __call__(self, x, cos, sin, segments):
        """x f32[N, P, C], (cos, sin) f32[N * P, E], segments i32[N, P] -> f32[N, P, C]."""
        n, p, c = x.shape
        m = self.num_heads
        qkv = self.qkv(self.attention_norm(x)).reshape(n * p, 3, m, c // m)  # [N*P, 3, M, E]
        queries = apply_rope(qkv[:, 0], cos, sin).reshape(n, p, m, c // m)
        keys = apply_rope(qkv[:, 1], cos, sin).reshape(n, p, m, c // m)
        values = qkv[:, 2].reshape(n, p, m, c // m)
        attended = segment_attention(queries, keys, values, segments)  # [N, P, M, E]
        x = x + self.o(attended.reshape(n, p, c))
        gate, up = jnp.split(self.gate_up(self.ffn_norm(x)), 2, axis=-1)
        return x + self.down(self.act(gate) * up)


class PixtralTower(nnx.Module):
    def __init__(self, vision: PixtralSettings, dtype):
        c = vision.hidden_size
        self.vision = vision
        k = vision.in_channels * vision.patch_size**2
        self.patch = param((c, k), dtype, ("embed", "embed"))  # the Conv2d's, bias-free
        self.ln_pre = RMSNorm(c, _NORM_EPS)
        self.blocks = stacked_layers(lambda: PixtralBlock(vision, dtype), vision.num_layers)

    def __call__(self, patches, positions, segments) -> jax.Array:
        """patches f32[N, P, K], positions i32[N, P, 2], segments i32[N, P] (-1: padding) ->
        each patch's features f32[N, P, C] after the blocks the model reads."""
        n, p, _ = patches.shape
        w = self.patch[...]
        x = jnp.einsum(
            "npk,ck->npc", patches.astype(w.dtype), w, preferred_element_type=jnp.float32
        )
        x = self.ln_pre(x)
        cos, sin = _rope_cos_sin(positions.reshape(n * p, 2), self.vision)  # [N*P, E]
        body = lambda block, x, layer, extra: block(x, cos, sin, segments)
        return scan_layers(self.blocks, body, x)

    @staticmethod
    def load_weights(weights: CheckpointWeights, vision: PixtralSettings, path: str, prefix: str):
        """The tower's params (under `path`) from HF's tensors under `prefix`."""
        weights.tensor(f"{path}.patch", prefix + "patch_conv.weight", flatten_conv)
        weights.tensor(f"{path}.ln_pre.weight", prefix + "ln_pre.weight")
        weights.set_layer_prefix(prefix + "transformer.layers.{}.")
        weights.set_layers(0, vision.num_layers, stack=f"{path}.blocks")
        attention = tuple(f"attention.{n}_proj.weight" for n in "qkv")
        for name, hf in (
            ("attention_norm", ("attention_norm.weight",)),
            ("qkv", attention),
            ("o", ("attention.o_proj.weight",)),
            ("ffn_norm", ("ffn_norm.weight",)),
            ("gate_up", ("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight")),
            ("down", ("feed_forward.down_proj.weight",)),
        ):
            weights.stacked(f"layers.{name}.weight", hf)
