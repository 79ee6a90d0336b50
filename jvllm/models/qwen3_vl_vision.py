"""Qwen3-VL's vision transformer as flax.nnx modules: an image's flattened patches -> one
embedding per group of merge x merge patches, and its DeepStack features, in the language
model's width. Not a registered family: models/qwen3_vl.py holds one.

Qwen2-VL's tower (models/qwen2_vl_vision.py: its blocks, 2-D rotary positions and segment
attention are reused) with three changes: the patch projection has a bias; a learned table of
num_position_embeddings positions (a square grid) is resampled bilinearly to each image's grid
of patches and added to the patches (HF's get_vision_interpolation_indices_and_weights, with
align_corners: the host computes each patch's four taps and weights, `position_taps`); and
after each block listed in deepstack_visual_indexes a merger of its own (normed after the
groups are formed) makes one more embedding per group, which the language model adds to the
image tokens after its first layers (DeepStack).

Letters as qwen2_vl_vision.py's; S a side of the position table, K2 DeepStack levels.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm
from jvllm.layers.params import param
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.qwen2_vl_vision import (
    _NORM_EPS,
    QwenVisionBlock,
    QwenVisionSettings,
    _rope_cos_sin,
    vision_arrays,
    vision_settings,
)
from jvllm.models.vit import flatten_conv
from jvllm.models.weights import CheckpointWeights


@dataclasses.dataclass(frozen=True)
class Qwen3VisionSettings(QwenVisionSettings):
    num_position_embeddings: int = 2304  # S^2
    deepstack_layers: tuple[int, ...] = ()  # the blocks after which a DeepStack merger reads

    def arrays(self, grid_thw) -> dict[str, np.ndarray]:
        """What the tower takes beside pixel_values of one image of grid_thw: vision_arrays'
        and position_taps'."""
        return {**vision_arrays(self, grid_thw), **position_taps(self, grid_thw)}


def qwen3_vision_settings(vision_config: dict) -> Qwen3VisionSettings:
    """The tower of a Qwen3-VL vision_config, with HF's defaults and errors naming the field."""
    vc = {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "out_hidden_size": 3584,
        **vision_config,
    }
    # Qwen2-VL's reading with its names: a width of hidden_size, a plain MLP of
    # intermediate_size, no windows.
    base = vision_settings(
        {**vc, "embed_dim": vc["hidden_size"], "hidden_size": vc["out_hidden_size"]}, False
    )
    base = dataclasses.replace(base, intermediate_size=vc["intermediate_size"])
    num_positions = vc.get("num_position_embeddings", 2304)
    side = math.isqrt(num_positions) if isinstance(num_positions, int) else 0
    if side < 2 or side * side != num_positions:
        raise ValueError(
            f"vision_config.num_position_embeddings must be a square of at least 4, got "
            f"{num_positions!r}"
        )
    deepstack = tuple(vc.get("deepstack_visual_indexes", (8, 16, 24)))
    is_increasing = all(a < b for a, b in itertools.pairwise(deepstack))
    if not is_increasing or not all(
        isinstance(i, int) and 0 <= i < base.num_layers for i in deepstack
    ):
        raise ValueError(
            f"vision_config.deepstack_visual_indexes={list(deepstack)} must name blocks of the "
            f"{base.num_layers}-block tower in increasing order"
        )
    return Qwen3VisionSettings(
        **dataclasses.asdict(base),
        num_position_embeddings=num_positions,
        deepstack_layers=deepstack,
    )


def position_taps(vision: Qwen3VisionSettings, grid_thw) -> dict[str, np.ndarray]:
    """Each patch's (processor order) bilinear taps into the S x S position table, resampled
    with align_corners to the image's h x w patches: "position_taps" i32[P, 4] (row-major
    indices) and "position_weights" f32[P, 4]."""
    t, h, w = (int(v) for v in grid_thw)
    m, side = vision.merge_size, math.isqrt(vision.num_position_embeddings)
    _, group_row, group_col, in_row, in_col = np.indices((t, h // m, w // m, m, m)).reshape(5, -1)

    def axis(index, size):  # -> taps i64[P, 2], weights f32[P, 2]
        source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(source)
        raw = floor.astype(np.int64)[:, None] + np.arange(2)
        weights = np.clip(1 - np.abs(source[:, None] - raw.astype(np.float32)), 0, None)
        return np.clip(raw, 0, side - 1), weights.astype(np.float32)

    row_taps, row_weights = axis(group_row * m + in_row, h)
    col_taps, col_weights = axis(group_col * m + in_col, w)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return {"position_taps": taps.astype(np.int32), "position_weights": weights}


class Qwen3PatchMerger(nnx.Module):
    """A group of U patches -> one embedding: LayerNorm (over each patch's C, or with
    `is_post_shuffle` over the group's U*C), then fc, exact GELU, fc."""

    def __init__(self, vision: Qwen3VisionSettings, is_post_shuffle: bool, dtype):
        c, u = vision.hidden_size, vision.group_size
        self.is_post_shuffle = is_post_shuffle
        self.norm = LayerNorm(u * c if is_post_shuffle else c, _NORM_EPS)
        self.fc1 = Linear(u * c, u * c, ("embed", "embed"), dtype=dtype, bias=True)
        self.fc2 = Linear(u * c, vision.out_size, ("embed", "embed"), dtype=dtype, bias=True)

    def __call__(self, x: jax.Array, group_size: int) -> jax.Array:
        """x f32[N, P, C] -> f32[N, G, D]."""
        n, p, c = x.shape
        if not self.is_post_shuffle:
            x = self.norm(x)
        x = x.reshape(n, p // group_size, group_size * c)
        if self.is_post_shuffle:
            x = self.norm(x)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class Qwen3VisionTower(nnx.Module):
    def __init__(self, vision: Qwen3VisionSettings, dtype):
        c = vision.hidden_size
        self.vision = vision
        self.patch = param((c, vision.patch_values), dtype, ("embed", "embed"))  # the Conv3d's
        self.patch_bias = param((c,), dtype, ("embed",))
        self.positions = param((vision.num_position_embeddings, c), dtype, ("embed", "embed"))
        self.blocks = stacked_layers(lambda: QwenVisionBlock(vision, dtype), vision.num_layers)
        self.merger = Qwen3PatchMerger(vision, False, dtype)
        num_levels = len(vision.deepstack_layers)
        make_merger = lambda: Qwen3PatchMerger(vision, True, dtype)
        self.deepstack = stacked_layers(make_merger, num_levels) if num_levels else None

    def __call__(
        self,
        pixel_values: jax.Array,
        vision_positions: jax.Array,
        attention_segments: jax.Array,
        position_taps: jax.Array,
        position_weights: jax.Array,
    ) -> jax.Array:
        """pixel_values f32[N, P, K] and image_arrays' arrays of each image (stacked on N) ->
        each group's embedding and its DeepStack features, f32[N, G, (1 + K2) * D]."""
        vision = self.vision
        n, p, _ = pixel_values.shape
        w = self.patch[...]
        x = jnp.einsum(
            "npk,ck->npc", pixel_values.astype(w.dtype), w, preferred_element_type=jnp.float32
        )
        x = x + self.patch_bias[...].astype(jnp.float32)
        table = self.positions[...].astype(jnp.float32)  # [S^2, C]
        x = x + jnp.einsum("npjc,npj->npc", table[position_taps], position_weights)
        cos, sin = _rope_cos_sin(vision_positions.reshape(n * p, 2), vision)  # [N*P, E]
        # Each block's DeepStack level (-1: none); the scan keeps each level's block output.
        num_levels = len(vision.deepstack_layers)
        levels = np.full(vision.num_layers, -1, np.int32)
        levels[list(vision.deepstack_layers)] = np.arange(num_levels)
        kept = jnp.zeros((max(num_levels, 1), *x.shape), x.dtype)  # [K2, N, P, C]

        def body(block, carry, layer, level):
            x, kept = carry
            x = block(x, cos, sin, attention_segments)
            slot = jnp.maximum(level, 0)
            old = jax.lax.dynamic_index_in_dim(kept, slot, 0, keepdims=False)
            row = jnp.where(level >= 0, x, old)  # [N, P, C]: this block's, or kept as it was
            return x, jax.lax.dynamic_update_index_in_dim(kept, row, slot, 0)

        x, kept = scan_layers(self.blocks, body, (x, kept), jnp.asarray(levels))
        u = vision.group_size
        out = self.merger(x, u)  # [N, G, D]
        if self.deepstack is None:
            return out

        def merge_level(merger, deep, level, features):
            return jax.lax.dynamic_update_index_in_dim(deep, merger(features, u), level, 0)

        deep = jnp.zeros((num_levels, *out.shape), out.dtype)  # [K2, N, G, D]
        deep = scan_layers(self.deepstack, merge_level, deep, kept)
        return jnp.concatenate([out, *deep], axis=-1)

    @staticmethod
    def load_weights(
        weights: CheckpointWeights, vision: Qwen3VisionSettings, path: str, prefix: str
    ) -> None:
        """The tower's params (under `path`, e.g. "visual") from HF's tensors under `prefix`
        ("model.visual." or "visual.")."""
        weights.tensor(f"{path}.patch", prefix + "patch_embed.proj.weight", flatten_conv)
        weights.tensor(f"{path}.patch_bias", prefix + "patch_embed.proj.bias")
        weights.tensor(f"{path}.positions", prefix + "pos_embed.weight")
        merger = (("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2"))
        for ours, theirs in merger:
            for kind in ("weight", "bias"):
                weights.tensor(f"{path}.merger.{ours}.{kind}", f"{prefix}merger.{theirs}.{kind}")
        if vision.deepstack_layers:
            weights.set_layer_prefix(prefix + "deepstack_merger_list.{}.")
            weights.set_layers(0, len(vision.deepstack_layers), stack=f"{path}.deepstack")
            for ours, theirs in merger:
                for kind in ("weight", "bias"):
                    weights.stacked(f"layers.{ours}.{kind}", (f"{theirs}.{kind}",))
        weights.set_layer_prefix(prefix + "blocks.{}.")
        weights.set_layers(0, vision.num_layers, stack=f"{path}.blocks")
        for name, hf in (
            ("norm1", "norm1"),
            ("norm2", "norm2"),
            ("qkv", "attn.qkv"),
            ("proj", "attn.proj"),
            ("mlp_in", "mlp.linear_fc1"),
            ("mlp_out", "mlp.linear_fc2"),
        ):
            for kind in ("weight", "bias"):
                weights.stacked(f"layers.{name}.{kind}", (f"{hf}.{kind}",))
