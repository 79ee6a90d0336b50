"""CLIP's vision transformer (LLaVA's image encoder) as flax.nnx modules: patches -> the hidden
states of a chosen layer. Not a registered family: the multimodal families hold one.

Letters: N images, P patches an image (plus one class token: Q = P + 1), C the tower's width,
F its MLP width, M its heads, E a head's width (C / M).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm
from jvllm.layers.params import param
from jvllm.layers.scan import scan_layers, stacked_layers
from jvllm.models.weights import CheckpointWeights


@dataclasses.dataclass(frozen=True)
class VisionSettings:
    """A vision tower's shape, read from a checkpoint's vision_config (hashable: it travels in
    ModelConfig.options)."""

    hidden_size: int  # C
    intermediate_size: int  # F
    num_heads: int  # M
    num_layers: int  # the layers that run: up to the one whose output is taken
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def num_patches(self) -> int:  # P
        return (self.image_size // self.patch_size) ** 2


# CLIP's activations by their HF names, in float32.
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def vision_settings(vision_config: dict, feature_layer: int) -> VisionSettings:
    """The tower of a CLIP vision_config that runs up to HF's hidden_states[feature_layer]
    (negative: from the end; hidden_states[0] is the embeddings), with errors naming the
    field."""
    act = vision_config.get("hidden_act", "quick_gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act={act!r} is not supported; allowed: {tuple(_ACTIVATIONS)}"
        )
    total = vision_config.get("num_hidden_layers", 12)
    if isinstance(feature_layer, bool) or not isinstance(feature_layer, int):
        raise TypeError(
            f"vision_feature_layer={feature_layer!r} is not supported; allowed: one int "
            "(a list of layers is not supported yet)"
        )
    num_layers = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 0 <= num_layers <= total:
        raise ValueError(
            f"vision_feature_layer={feature_layer} names no layer of the {total}-layer tower"
        )
    return VisionSettings(
        hidden_size=vision_config.get("hidden_size", 768),
        intermediate_size=vision_config.get("intermediate_size", 3072),
        num_heads=vision_config.get("num_attention_heads", 12),
        num_layers=num_layers,
        image_size=vision_config.get("image_size", 224),
        patch_size=vision_config.get("patch_size", 32),
        layer_norm_eps=vision_config.get("layer_norm_eps", 1e-5),
        hidden_act=act,
    )


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, vision: VisionSettings, dtype):
        c, f = vision.hidden_size, vision.intermediate_size
        self.num_heads = vision.num_heads
        self.act = _ACTIVATIONS[vision.hidden_act]
        self.norm1 = LayerNorm(c, vision.layer_norm_eps)
        self.qkv = Linear(c, 3 * c, ("embed", "embed"), dtype=dtype, bias=True)
        self.out = Linear(c, c, ("embed", "embed"), dtype=dtype, bias=True)
        self.norm2 = LayerNorm(c, vision.layer_norm_eps)
        self.fc1 = Linear(c, f, ("embed", "embed"), dtype=dtype, bias=True)
        self.fc2 = Linear(f, c, ("embed", "embed"), dtype=dtype, bias=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x f32[N, Q, C] -> f32[N, Q, C]: bidirectional attention over each image's tokens,
        then the MLP, each pre-norm with a residual."""
        n, q, c = x.shape
        m = self.num_heads
        qkv = self.qkv(self.norm1(x)).reshape(n, q, 3, m, c // m)  # [N, Q, 3, M, E]
        queries, keys, values = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("nqme,nkme->nmqk", queries, keys) * (c // m) ** -0.5
        probs = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("nmqk,nkme->nqme", probs, values).reshape(n, q, c)
        x = x + self.out(attended)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class CLIPVisionTower(nnx.Module):
    def __init__(self, vision: VisionSettings, dtype):
        c, p = vision.hidden_size, vision.patch_size
        self.vision = vision
        self.patch = param((c, 3 * p * p), dtype, ("embed", "embed"))  # the conv's [C, 3, p, p]
        self.class_embedding = param((c,), jnp.float32, ("embed",))
        self.positions = param((vision.num_patches + 1, c), jnp.float32, ("positions", "embed"))
        self.pre_norm = LayerNorm(c, vision.layer_norm_eps)
        self.layers = stacked_layers(lambda: CLIPEncoderLayer(vision, dtype), vision.num_layers)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """pixel_values f32[N, 3, S, S] -> the chosen layer's hidden states f32[N, Q, C]
        (class token first)."""
        n, p = pixel_values.shape[0], self.vision.patch_size
        g = self.vision.image_size // p  # patches a side
        # Non-overlapping p x p patches flattened as the conv's (channel, row, column) order.
        patches = pixel_values.reshape(n, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, g * g, 3 * p * p)  # [N, P, 3pp]
        w = self.patch[...]
        x = jnp.einsum(
            "npk,ck->npc", patches.astype(w.dtype), w, preferred_element_type=jnp.float32
        )
        cls = jnp.broadcast_to(self.class_embedding[...], (n, 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.positions[...]  # [N, Q, C]
        x = self.pre_norm(x)
        return scan_layers(self.layers, lambda layer, x, i, _: layer(x), x)

    @staticmethod
    def load_weights(weights: CheckpointWeights, path: str, prefix: str, num_layers: int) -> None:
        """The tower's params (under `path`, e.g. "vision") from HF's CLIPVisionModel tensors
        under `prefix` ("vision_tower.vision_model." or "vision_tower.")."""
        weights.tensor(f"{path}.patch", prefix + "embeddings.patch_embedding.weight", _flatten_conv)
        weights.tensor(f"{path}.class_embedding", prefix + "embeddings.class_embedding")
        weights.tensor(f"{path}.positions", prefix + "embeddings.position_embedding.weight")
        weights.tensor(f"{path}.pre_norm.weight", prefix + "pre_layrnorm.weight")
        weights.tensor(f"{path}.pre_norm.bias", prefix + "pre_layrnorm.bias")
        weights.set_layer_prefix(prefix + "encoder.layers.{}.")
        weights.set_layers(0, num_layers, stack=f"{path}.layers")
        attn = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        for name, hf in (
            ("norm1", "layer_norm1"),
            ("norm2", "layer_norm2"),
            ("out", "self_attn.out_proj"),
            ("fc1", "mlp.fc1"),
            ("fc2", "mlp.fc2"),
        ):
            weights.stacked(f"layers.{name}.weight", (hf + ".weight",))
            weights.stacked(f"layers.{name}.bias", (hf + ".bias",))
        weights.stacked("layers.qkv.weight", tuple(n + ".weight" for n in attn))
        weights.stacked("layers.qkv.bias", tuple(n + ".bias" for n in attn))


def _flatten_conv(w):
    """The patch conv's weight [C, 3, p, p] as a matrix [C, 3pp]."""
    return w.reshape(w.shape[0], -1)
