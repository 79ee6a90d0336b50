"""Qwen2-VL's and Qwen2.5-VL's vision transformer as flax.nnx modules: an image's flattened
patches -> one embedding per group of merge x merge patches, in the language model's width.
Not a registered family: models/qwen2_vl.py holds one.

The image processor gives each image as P patches of K values (a Conv3d's input, flattened)
in groups of U = merge^2 neighbours, group after group in raster order. The tower runs one
batch of images of the same P: attention stays within each image, and within each window of
Qwen2.5-VL's windowed layers. Where each patch sits (its 2-D rotary position, its frame, its
window) depends only on the image's grid, so `image_arrays` computes it on the host and the
compiled tower has no data-dependent shape.

HF's Qwen2.5-VL reorders the groups window by window before the blocks (and back after the
merger), so that each window is one contiguous run for its varlen attention kernels. Here the
windows are attention segments, ids compared in the mask, which gives the same attention in
the processor's order, so nothing is reordered.

Letters: N images, P patches an image, U patches a group (merge^2), G groups (P / U), K a
patch's values, C the tower's width, F its MLP width, M its heads, E a head's width (C / M), D
the language model's width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm, RMSNorm
from jvllm.layers.params import param
from jvllm.layers.rotary import apply_rope
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.vit import flatten_conv
from jvllm.models.weights import CheckpointWeights

# HF's vision activations by name, in float32.
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}
_NORM_EPS = 1e-6  # HF's, fixed for the blocks' and the merger's norms
_DEFAULT_ROPE_THETA = 10000.0
# The queries a chunk of the tower's attention (segment_attention).
_QUERY_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class QwenVisionSettings:
    """The tower's shape, read from a checkpoint's vision_config (hashable: it travels in
    ModelConfig.options)."""

    hidden_size: int  # C
    intermediate_size: int  # F
    num_heads: int  # M
    num_layers: int
    out_size: int  # D
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    hidden_act: str
    rope_theta: float
    # Qwen2.5-VL: RMSNorms, a gated MLP, and windowed attention in every layer not listed in
    # `full_attention_layers`; Qwen2-VL: LayerNorms, a plain MLP, every layer full.
    is_qwen2_5: bool
    window_size: int  # a window's side in pixels (Qwen2.5-VL)
    full_attention_layers: tuple[int, ...]

    @property
    def patch_values(self) -> int:  # K
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def group_size(self) -> int:  # U
        return self.merge_size**2

    @property
    def has_windows(self) -> bool:
        return self.is_qwen2_5 and len(self.full_attention_layers) < self.num_layers

    def arrays(self, grid_thw) -> dict[str, np.ndarray]:
        """What the tower takes beside pixel_values of one image of grid_thw (vision_arrays)."""
        return vision_arrays(self, grid_thw)


def vision_settings(vision_config: dict, is_qwen2_5: bool) -> QwenVisionSettings:
    """The tower of a Qwen2-VL (or, with `is_qwen2_5`, a Qwen2.5-VL) vision_config, with HF's
    defaults and errors naming the field."""
    vc = vision_config
    default_act = "silu" if is_qwen2_5 else "quick_gelu"
    act = vc.get("hidden_act", default_act)
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act={act!r} is not supported; allowed: {tuple(_ACTIVATIONS)}"
        )
    num_layers = vc.get("depth", 32)
    if is_qwen2_5:
        width = vc.get("hidden_size", 3584)
        mlp_width = vc.get("intermediate_size", 3420)
        out_size = vc.get("out_hidden_size", 3584)
        full = tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31)))
        window_size = vc.get("window_size", 112)
    else:
        width = vc.get("embed_dim", 1280)
        mlp_width = int(width * vc.get("mlp_ratio", 4))
        out_size = vc.get("hidden_size", 3584)
        full, window_size = tuple(range(num_layers)), 0
    sizes = {
        name: vc.get(name, default)
        for name, default in (
            ("patch_size", 14),
            ("temporal_patch_size", 2),
            ("spatial_merge_size", 2),
        )
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"vision_config.{name} must be a positive int, got {value!r}")
    settings = QwenVisionSettings(
        hidden_size=width,
        intermediate_size=mlp_width,
        num_heads=vc.get("num_heads", 16),
        num_layers=num_layers,
        out_size=out_size,
        in_channels=vc.get("in_channels", vc.get("in_chans", 3)),
        patch_size=sizes["patch_size"],
        temporal_patch_size=sizes["temporal_patch_size"],
        merge_size=sizes["spatial_merge_size"],
        hidden_act=act,
        rope_theta=float((vc.get("rope_parameters") or {}).get("rope_theta", _DEFAULT_ROPE_THETA)),
        is_qwen2_5=is_qwen2_5,
        window_size=window_size,
        full_attention_layers=full,
    )
    if width % settings.num_heads or (width // settings.num_heads) % 4:
        raise ValueError(
            f"the vision tower's width {width} must split into {settings.num_heads} heads of a "
            "multiple of 4 dims (2-D rotary embeddings)"
        )
    if settings.has_windows and window_size < settings.patch_size * settings.merge_size:
        raise ValueError(
            f"vision_config.window_size={window_size} must be at least patch_size * "
            f"spatial_merge_size = {settings.patch_size * settings.merge_size} pixels"
        )
    if not all(0 <= i < num_layers for i in full):
        raise ValueError(
            f"vision_config.fullatt_block_indexes={list(full)} names layers outside the "
            f"{num_layers}-layer tower"
        )
    return settings


def vision_arrays(vision: QwenVisionSettings, grid_thw) -> dict[str, np.ndarray]:
    """What the tower needs of one image's grid (t, h, w in patches), per patch in the
    processor's order (frame, group row, group column, row in the group, column in the group):
    - "vision_positions" i32[P, 2]: its (row, column), the 2-D rotary positions;
    - "attention_segments" i32[P]: its frame, within which the full layers attend;
    - "window_segments" i32[P] (Qwen2.5-VL): its window of window_size pixels a side (HF's
      get_vision_window_index), within which the windowed layers attend."""
    t, h, w = (int(v) for v in grid_thw)
    m = vision.merge_size
    if min(t, h, w) <= 0 or h % m or w % m:
        raise ValueError(f"image grid {(t, h, w)} must be positive, h and w multiples of {m}")
    frame, group_row, group_col, in_row, in_col = np.indices((t, h // m, w // m, m, m)).reshape(
        5, -1
    )
    positions = np.stack([group_row * m + in_row, group_col * m + in_col], axis=-1)
    arrays = {
        "vision_positions": positions.astype(np.int32),
        "attention_segments": frame.astype(np.int32),
    }
    if vision.has_windows:
        side = vision.window_size // m // vision.patch_size  # a window's side in groups
        rows, cols = -(-(h // m) // side), -(-(w // m) // side)  # windows a frame
        window = (frame * rows + group_row // side) * cols + group_col // side
        arrays["window_segments"] = window.astype(np.int32)
    return arrays


class QwenVisionBlock(nnx.Module):
    def __init__(self, vision: QwenVisionSettings, dtype):
        c, f = vision.hidden_size, vision.intermediate_size
        norm = RMSNorm if vision.is_qwen2_5 else LayerNorm
        self.num_heads = vision.num_heads
        self.act = _ACTIVATIONS[vision.hidden_act]
        self.is_gated = vision.is_qwen2_5
        self.norm1 = norm(c, _NORM_EPS)
        self.qkv = Linear(c, 3 * c, ("embed", "embed"), dtype=dtype, bias=True)
        self.proj = Linear(c, c, ("embed", "embed"), dtype=dtype, bias=True)
        self.norm2 = norm(c, _NORM_EPS)
        if self.is_gated:  # Qwen2.5-VL: down(act(gate) * up), gate|up fused
            self.mlp_in = Linear(c, 2 * f, ("embed", "embed"), dtype=dtype, bias=True)
        else:
            self.mlp_in = Linear(c, f, ("embed", "embed"), dtype=dtype, bias=True)
        self.mlp_out = Linear(f, c, ("embed", "embed"), dtype=dtype, bias=True)

    def __call__(self, x, cos, sin, segments):
        """x f32[N, P, C], (cos, sin) f32[N * P, E], segments i32[N, P] -> f32[N, P, C]:
        attention among the patches of an image that share a segment, then the MLP, each
        pre-norm with a residual."""
        n, p, c = x.shape
        m = self.num_heads
        qkv = self.qkv(self.norm1(x)).reshape(n * p, 3, m, c // m)  # [N*P, 3, M, E]
        queries = apply_rope(qkv[:, 0], cos, sin).reshape(n, p, m, c // m)
        keys = apply_rope(qkv[:, 1], cos, sin).reshape(n, p, m, c // m)
        values = qkv[:, 2].reshape(n, p, m, c // m)
        attended = segment_attention(queries, keys, values, segments)  # [N, P, M, E]
        x = x + self.proj(attended.reshape(n, p, c))
        h = self.mlp_in(self.norm2(x))
        if self.is_gated:
            gate, up = jnp.split(h, 2, axis=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return x + self.mlp_out(h)


class QwenVisionTower(nnx.Module):
    def __init__(self, vision: QwenVisionSettings, dtype):
        c, u = vision.hidden_size, vision.group_size
        norm = RMSNorm if vision.is_qwen2_5 else LayerNorm
        self.vision = vision
        self.patch = param((c, vision.patch_values), dtype, ("embed", "embed"))  # the Conv3d's
        self.blocks = stacked_layers(lambda: QwenVisionBlock(vision, dtype), vision.num_layers)
        self.merger_norm = norm(c, _NORM_EPS)
        self.merger_in = Linear(u * c, u * c, ("embed", "embed"), dtype=dtype, bias=True)
        self.merger_out = Linear(u * c, vision.out_size, ("embed", "embed"), dtype=dtype, bias=True)

    def __call__(
        self,
        pixel_values: jax.Array,
        vision_positions: jax.Array,
        attention_segments: jax.Array,
        window_segments: jax.Array | None = None,
    ) -> jax.Array:
        """pixel_values f32[N, P, K] and vision_arrays' arrays of each image (stacked on N) ->
        each group's embedding f32[N, G, D]."""
        vision = self.vision
        n, p, _ = pixel_values.shape
        w = self.patch[...]
        x = jnp.einsum(
            "npk,ck->npc", pixel_values.astype(w.dtype), w, preferred_element_type=jnp.float32
        )
        cos, sin = _rope_cos_sin(vision_positions.reshape(n * p, 2), vision)  # [N*P, E]
        if vision.has_windows != (window_segments is not None):
            raise ValueError(
                "window_segments (image_arrays') must be given exactly to a tower with windowed "
                "layers (Qwen2.5-VL)"
            )
        per_layer = None
        if window_segments is not None:
            is_full = np.isin(np.arange(vision.num_layers), vision.full_attention_layers)
            per_layer = jnp.asarray(is_full)  # bool[L]

        def body(block, x, layer, is_full):
            segments = attention_segments
            if is_full is not None:
                segments = jnp.where(is_full, attention_segments, window_segments)
            return block(x, cos, sin, segments)

        x = scan_layers(self.blocks, body, x, per_layer)
        u = vision.group_size
        x = self.merger_norm(x).reshape(n, p // u, u * x.shape[-1])  # [N, G, U*C]
        return self.merger_out(jax.nn.gelu(self.merger_in(x), approximate=False))

    @staticmethod
    def load_weights(
        weights: CheckpointWeights, vision: QwenVisionSettings, path: str, prefix: str
    ) -> None:
        """The tower's params (under `path`, e.g. "visual") from HF's tensors under `prefix`
        ("visual." or "model.visual.")."""
        weights.tensor(f"{path}.patch", prefix + "patch_embed.proj.weight", flatten_conv)
        has_bias = not vision.is_qwen2_5  # LayerNorm's
        norms = [(f"{path}.merger_norm", "merger.ln_q")]
        for name, hf in norms:
            weights.tensor(f"{name}.weight", f"{prefix}{hf}.weight")
            if has_bias:
                weights.tensor(f"{name}.bias", f"{prefix}{hf}.bias")
        for name, hf in (("merger_in", "merger.mlp.0"), ("merger_out", "merger.mlp.2")):
            weights.tensor(f"{path}.{name}.weight", f"{prefix}{hf}.weight")
            weights.tensor(f"{path}.{name}.bias", f"{prefix}{hf}.bias")
        weights.set_layer_prefix(prefix + "blocks.{}.")
        weights.set_layers(0, vision.num_layers, stack=f"{path}.blocks")
        for name in ("norm1", "norm2"):
            weights.stacked(f"layers.{name}.weight", (name + ".weight",))
            if has_bias:
                weights.stacked(f"layers.{name}.bias", (name + ".bias",))
        mlp_in = ("mlp.gate_proj", "mlp.up_proj") if vision.is_qwen2_5 else ("mlp.fc1",)
        mlp_out = "mlp.down_proj" if vision.is_qwen2_5 else "mlp.fc2"
        for name, hf in (
            ("qkv", ("attn.qkv",)),
            ("proj", ("attn.proj",)),
            ("mlp_in", mlp_in),
            ("mlp_out", (mlp_out,)),
        ):
            weights.stacked(f"layers.{name}.weight", tuple(n + ".weight" for n in hf))
            weights.stacked(f"layers.{name}.bias", tuple(n + ".bias" for n in hf))


def segment_attention(queries, keys, values, segments, query_chunk: int | None = None):
    """Bidirectional attention of queries, keys, values f32[N, P, M, E] among the patches of
    an image that share a segment (segments i32[N, P]) -> f32[N, P, M, E]. The queries go
    `query_chunk` (default _QUERY_CHUNK) at a time, so that the scores take [N, M, chunk, P],
    not [N, M, P, P]: 17 GB a head for HF's largest images (65536 patches) at once."""
    n, p, m, e = queries.shape
    chunk = min(p, query_chunk or _QUERY_CHUNK)
    num_chunks = -(-p // chunk)
    pad = num_chunks * chunk - p  # the last chunk's padding queries, dropped after

    def attend(chunk_queries, chunk_segments):  # [N, chunk, M, E], [N, chunk]
        scores = jnp.einsum("nqme,nkme->nmqk", chunk_queries, keys) * e**-0.5
        is_seen = chunk_segments[:, None, :, None] == segments[:, None, None, :]
        probs = jax.nn.softmax(jnp.where(is_seen, scores, -jnp.inf), axis=-1)
        return jnp.einsum("nmqk,nkme->nqme", probs, values)

    if num_chunks == 1:
        return attend(queries, segments)
    # A padding query takes its image's last patch's segment, so that its row sees a key.
    queries = jnp.pad(queries, ((0, 0), (0, pad), (0, 0), (0, 0)))
    query_segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge")
    queries = queries.reshape(n, num_chunks, chunk, m, e).swapaxes(0, 1)
    query_segments = query_segments.reshape(n, num_chunks, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: attend(*xs), (queries, query_segments))  # [chunks, N, ...]
    return out.swapaxes(0, 1).reshape(n, num_chunks * chunk, m, e)[:, :p]


def _rope_cos_sin(positions: jax.Array, vision: QwenVisionSettings):
    """positions i32[T, 2] (row, column) -> (cos, sin) f32[T, E]: HF's axial 2-D rotary
    embedding, E/4 frequencies of a quarter-head base each turned by the row and by the column,
    [rows | columns] as the first half of a rotate-half head and again as the second."""
    e = vision.hidden_size // vision.num_heads
    exponents = np.arange(0, e // 2, 2, dtype=np.float32) / np.float32(e // 2)
    inv_freq = jnp.asarray(1.0 / (np.float32(vision.rope_theta) ** exponents))  # [E/4]
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [T, 2, E/4]
    angles = angles.reshape(angles.shape[0], -1)  # [T, E/2]: rows' then columns'
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, E]
    return jnp.cos(angles), jnp.sin(angles)
