"""Mistral 3 (Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2, Magistral-Small-2509):
a Pixtral vision tower (models/pixtral_vision.py) over each image at its own resolution, a
projector that RMS-norms the patches, merges each spatial_merge_size^2 square of them into one
(a learned linear map, HF's Mistral3PatchMerger) and maps it into the text model's width, and a
Mistral text model that reads the merged patches in place of the prompt's [IMG] tokens.

An image of h x w patches is written, as PixtralProcessor writes it, as h/m rows of w/m [IMG]
tokens, each row ended by [IMG_BREAK] and the last by [IMG_END]: only the [IMG] tokens take
embeddings. jvllm runs the image processor alone (with the merged patch's side as its patch
size, as PixtralProcessor passes it) and writes the tokens itself (`image_tokens`).

The runner encodes each image once (worker/encoder_runner.py), padded to a power of two of
patches so that image sizes share executables; the padding's embeddings come last and are
dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.layers.activation import ACTIVATIONS, check_activation
from jvllm.layers.linear import Linear
from jvllm.layers.norm import RMSNorm
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.llava import checkpoint_layout, load_projector
from jvllm.models.ministral3 import normalize_ministral3
from jvllm.models.pixtral_vision import PixtralTower, image_patches, pixtral_settings
from jvllm.models.weights import CheckpointWeights

_TEXT_MODEL_TYPES = ("mistral", "llama", "ministral3")
_IMAGE_TOKENS = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
# Patches an image's arrays are padded to at least (and else to a power of two).
_MIN_PADDED_PATCHES = 64


def _normalize(cfg: dict) -> dict:
    text = dict(cfg.get("text_config") or {})
    model_type = text.get("model_type", "mistral")
    if model_type not in _TEXT_MODEL_TYPES:
        raise ValueError(
            f"text_config.model_type={model_type!r} is not supported in a Mistral 3 "
            f"checkpoint; allowed: {_TEXT_MODEL_TYPES}"
        )
    if model_type == "ministral3":  # Llama 4's query scaling, YaRN by default
        text = normalize_ministral3(text)
    else:
        text["model_type"], text["architectures"] = model_type, ["MistralForCausalLM"]
        text = LlamaForCausalLM.normalize_hf_config(text)
    text["architectures"] = ["Mistral3ForConditionalGeneration"]
    for name in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if cfg.get(name) is not None:
            text[name] = cfg[name]
    merge = cfg.get("spatial_merge_size", 2)
    if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1:
        raise ValueError(f"spatial_merge_size must be a positive int, got {merge!r}")
    image_token_id = cfg.get("image_token_index", cfg.get("image_token_id", 10))
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
        raise TypeError(f"image_token_index must be an int, got {image_token_id!r}")
    vision = {"image_size": 1540, "patch_size": 14, **(cfg.get("vision_config") or {})}
    text["options"] = {
        **text.get("options", {}),
        "vision": pixtral_settings(vision, cfg.get("vision_feature_layer", -1)),
        "spatial_merge_size": merge,
        "image_token_id": image_token_id,
        "projector_act": check_activation(
            cfg.get("projector_hidden_act", "gelu"), "projector_hidden_act"
        ),
        "projector_bias": bool(cfg.get("multimodal_projector_bias", False)),
    }
    return text


def _merged_patch_side(config: ModelConfig) -> int:
    """A merged patch's side in pixels: the image processor's patch size."""
    return config.option("vision").patch_size * config.option("spatial_merge_size")


def image_processor_kwargs(config: ModelConfig) -> dict:
    """What PixtralProcessor passes its image processor: the merged patch's side as the patch
    size, so that the image's sides are multiples of it."""
    return {"patch_size": _merged_patch_side(config)}


def image_inputs(config: ModelConfig, outputs: dict) -> tuple[dict[str, np.ndarray], tuple]:
    """(what encode_images takes of one image, its grid (h, w) in patches) from the image
    processor's outputs for that image alone: pixel_values [1, 3, H', W'] (padded) and
    image_sizes [1, 2]. The patches are padded to a power of two, with segment -1; each merged
    patch lists its m^2 patches (`merge_index`, row by row within the square), the padding's
    merged patches patch 0."""
    vision, m = config.option("vision"), config.option("spatial_merge_size")
    height, width = (int(v) for v in np.asarray(outputs["image_sizes"])[0])
    pixels = np.asarray(outputs["pixel_values"], np.float32)[0, :, :height, :width]
    data = image_patches(vision, pixels)
    h, w = height // vision.patch_size, width // vision.patch_size
    if h % m or w % m:
        raise ValueError(f"an image of {h} x {w} patches does not merge in squares of {m}")
    rows, cols, in_row, in_col = np.indices((h // m, w // m, m, m)).reshape(4, -1)
    merge_index = ((rows * m + in_row) * w + cols * m + in_col).reshape(-1, m * m).astype(np.int32)
    num_patches = h * w
    padded = max(_MIN_PADDED_PATCHES, 1 << (num_patches - 1).bit_length())
    pad = padded - num_patches
    data = {
        "patches": np.pad(data["patches"], ((0, pad), (0, 0))),
        "positions": np.pad(data["positions"], ((0, pad), (0, 0))),
        "segments": np.pad(np.zeros(num_patches, np.int32), (0, pad), constant_values=-1),
        "merge_index": np.pad(merge_index, ((0, padded // m**2 - len(merge_index)), (0, 0))),
    }
    return data, (h, w)


def image_num_embeds_for(config: ModelConfig, grid) -> int:
    m = config.option("spatial_merge_size")
    h, w = grid
    return (h // m) * (w // m)


def image_tokens(config: ModelConfig, grid: tuple, tokenizer=None) -> list[int]:
    """The tokens in place of an image's placeholder, as PixtralProcessor writes them: a row of
    [IMG] a merged patch, [IMG_BREAK] after each row, [IMG_END] after the last."""
    if tokenizer is None:
        raise ValueError("a Mistral 3 model writes its images' tokens with its tokenizer")
    image = config.option("image_token_id")
    row_break, end = (tokenizer.convert_tokens_to_ids(t) for t in _IMAGE_TOKENS.values())
    m = config.option("spatial_merge_size")
    rows, cols = grid[0] // m, grid[1] // m
    tokens = ([image] * cols + [row_break]) * rows
    tokens[-1] = end
    return tokens


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    normalize_hf_config = staticmethod(_normalize)
    image_processor_kwargs = staticmethod(image_processor_kwargs)
    image_inputs = staticmethod(image_inputs)
    image_tokens = staticmethod(image_tokens)
    image_num_embeds_for = staticmethod(image_num_embeds_for)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        dtype, d = jnp.dtype(config.dtype), config.hidden_size
        vision, m = config.option("vision"), config.option("spatial_merge_size")
        c, bias = vision.hidden_size, config.option("projector_bias")
        self.vision = PixtralTower(vision, dtype)
        self.projector_norm = RMSNorm(c, config.rms_norm_eps)
        self.patch_merger = Linear(m * m * c, c, ("embed", "embed"), dtype=dtype)
        self.projector_in = Linear(c, d, ("embed", "embed"), dtype=dtype, bias=bias)
        self.projector_out = Linear(d, d, ("embed", "embed"), dtype=dtype, bias=bias)

    def encode_images(self, patches, positions, segments, merge_index) -> jax.Array:
        """image_inputs' arrays of a batch of images, stacked on N -> each image's embeddings
        f32[N, G, D], one a merged patch (G: P / m^2, the padding's last)."""
        features = self.projector_norm(self.vision(patches, positions, segments))  # [N, P, C]
        n = features.shape[0]
        squares = jax.vmap(lambda f, i: f[i])(features, merge_index)  # [N, G, m^2, C]
        # HF's unfold: each square's features channel by channel, its patches within.
        squares = squares.swapaxes(-1, -2).reshape(n, merge_index.shape[1], -1)  # [N, G, C*m^2]
        merged = self.patch_merger(squares)  # [N, G, C]
        act = ACTIVATIONS[self.config.option("projector_act")]
        return self.projector_out(act(self.projector_in(merged)))

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        """The most embeddings one image takes: the image processor fits an image within
        vision_config.image_size pixels a side."""
        side = config.option("vision").image_size // _merged_patch_side(config)
        return side * side

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        text, lm_head, outer = checkpoint_layout(weights)
        vision = config.option("vision")
        PixtralTower.load_weights(weights, vision, "vision", outer + "vision_tower.")
        projector = outer + "multi_modal_projector."
        weights.tensor("projector_norm.weight", projector + "norm.weight")
        weights.tensor("patch_merger.weight", projector + "patch_merger.merging_layer.weight")
        load_projector(weights, projector, config.option("projector_bias"))
        weights.set_layers(0, config.num_layers)
        super().load_weights(config, weights, prefix=text, lm_head=lm_head)
