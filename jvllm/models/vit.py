"""The vision transformer layer that CLIP and SigLIP towers share, and the settings of a
tower: pre-norm blocks of bidirectional attention over each image's patches and an MLP.

Letters: N images, Q patches an image (with a CLIP's class token), C the tower's width, F its
MLP width, M its heads, E a head's width (C / M).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.layers.linear import Linear
from jvllm.layers.norm import LayerNorm
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


# The towers' activations by their HF names, in float32.
ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def patch_embeddings(pixel_values: jax.Array, weight: jax.Array, patch_size: int) -> jax.Array:
    """pixel_values f32[N, 3, S, S] through a patch conv (stride = kernel) of weight [C, 3pp]
    -> f32[N, P, C], the patches in row-major order."""
    n, _, size, _ = pixel_values.shape
    p, g = patch_size, size // patch_size  # g patches a side
    patches = pixel_values.reshape(n, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(n, g * g, 3 * p * p).astype(weight.dtype)  # the conv's order
    return jnp.einsum("npk,ck->npc", patches, weight, preferred_element_type=jnp.float32)


def flatten_conv(w):
    """A patch conv's weight [C, 3, p, p] (or a Conv3d's [C, 3, t, p, p]) as a matrix
    [C, 3pp] ([C, 3tpp])."""
    return w.reshape(w.shape[0], -1)


def vision_settings(vision_config: dict, feature_layer: int) -> VisionSettings:
    """The tower of a vision_config (every field given: the caller fills in its HF config
    class's defaults) that runs up to HF's hidden_states[feature_layer] (negative: from the
    end; hidden_states[0] is the embeddings; -1: every layer), with errors naming the field."""
    act = vision_config["hidden_act"]
    if act not in ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act={act!r} is not supported; allowed: {tuple(ACTIVATIONS)}"
        )
    total = vision_config["num_hidden_layers"]
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
        hidden_size=vision_config["hidden_size"],
        intermediate_size=vision_config["intermediate_size"],
        num_heads=vision_config["num_attention_heads"],
        num_layers=num_layers,
        image_size=vision_config["image_size"],
        patch_size=vision_config["patch_size"],
        layer_norm_eps=vision_config["layer_norm_eps"],
        hidden_act=act,
    )


class ViTLayer(nnx.Module):
    def __init__(self, vision: VisionSettings, dtype):
        c, f = vision.hidden_size, vision.intermediate_size
        self.num_heads = vision.num_heads
        self.act = ACTIVATIONS[vision.hidden_act]
        self.norm1 = LayerNorm(c, vision.layer_norm_eps)
        self.qkv = Linear(c, 3 * c, ("embed", "embed"), dtype=dtype, bias=True)
        self.out = Linear(c, c, ("embed", "embed"), dtype=dtype, bias=True)
        self.norm2 = LayerNorm(c, vision.layer_norm_eps)
        self.fc1 = Linear(c, f, ("embed", "embed"), dtype=dtype, bias=True)
        self.fc2 = Linear(f, c, ("embed", "embed"), dtype=dtype, bias=True)

    def __call__(self, x: jax.Array, key_mask: jax.Array | None = None) -> jax.Array:
        """x f32[N, Q, C] -> f32[N, Q, C]: bidirectional attention over each image's tokens
        (those where `key_mask` bool[N, Q], where given: a padded image's real patches), then
        the MLP, each pre-norm with a residual."""
        n, q, c = x.shape
        m = self.num_heads
        qkv = self.qkv(self.norm1(x)).reshape(n, q, 3, m, c // m)  # [N, Q, 3, M, E]
        queries, keys, values = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("nqme,nkme->nmqk", queries, keys) * (c // m) ** -0.5
        if key_mask is not None:
            scores = jnp.where(key_mask[:, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("nmqk,nkme->nqme", probs, values).reshape(n, q, c)
        x = x + self.out(attended)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def load_vit_layers(weights: CheckpointWeights, path: str, prefix: str, num_layers: int) -> None:
    """A stack of ViTLayers (at `path`.layers) from HF's CLIP / SigLIP encoder tensors under
    `prefix`."encoder.layers.{i}."."""
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
