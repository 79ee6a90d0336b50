"""LLaVA-NeXT (LlavaNextForConditionalGeneration): LLaVA-1.5's CLIP tower, projector and text
model (models/llava.py) over an image cut into tiles at any resolution.

The image processor picks the grid of tiles that best fits the image among
`image_grid_pinpoints`, resizes and pads the image to it, and gives the tiles after a resized
copy of the whole image (the base). Each tile goes through the tower and the projector alone.
The model then lays the tiles' features out as the grid they came from, drops the rows (or
columns) of features that only saw the padding (HF's unpad_image, to the original image's
aspect ratio), appends the learned `image_newline` after each row, and puts the base's
features first (HF's pack_image_features). How many embeddings an image takes thus depends on
its size, so the host computes which feature goes where (`feature_rows`), and the encoder only
gathers: its shapes are the image's tiles and embeddings, the same for images of one size.

Letters: N images, U tiles an image (the base first), S a tile's side in pixels, P patches a
tile, D the text model's width, I an image's embeddings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.layers.params import param
from jvllm.models.llava import LlavaForConditionalGeneration
from jvllm.models.weights import CheckpointWeights

# LlavaNextConfig's, where a config.json gives none.
_DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def _normalize(cfg: dict) -> dict:
    """LLaVA-1.5's text model, tower and projector settings, and the grids of tiles."""
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ValueError(
            f"vision_feature_select_strategy={strategy!r} is not supported in a LLaVA-NeXT "
            "checkpoint (its tiles' features are laid out one a patch); allowed: 'default'"
        )
    aspect = cfg.get("vision_aspect_ratio")
    if aspect not in (None, "anyres"):
        raise ValueError(
            f"vision_aspect_ratio={aspect!r} is not supported (the 'anyres_max_*' variants are "
            "LLaVA-OneVision's); allowed: 'anyres'"
        )
    text = LlavaForConditionalGeneration.normalize_hf_config(cfg)
    text["architectures"] = ["LlavaNextForConditionalGeneration"]
    tile = text["options"]["vision"].image_size
    pinpoints = cfg.get("image_grid_pinpoints") or _DEFAULT_PINPOINTS
    try:
        pinpoints = tuple((int(h), int(w)) for h, w in pinpoints)
    except (TypeError, ValueError):
        raise ValueError(
            f"image_grid_pinpoints={pinpoints!r} must be a list of [height, width] pairs"
        ) from None
    if not pinpoints or any(h <= 0 or w <= 0 or h % tile or w % tile for h, w in pinpoints):
        raise ValueError(
            f"image_grid_pinpoints={[list(p) for p in pinpoints]} must be a non-empty list of "
            f"[height, width] pairs, each a positive multiple of vision_config.image_size={tile}"
        )
    text["options"] = {**text["options"], "image_grid_pinpoints": pinpoints}
    return text


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that an image of `height` x `width` pixels is
    resized and padded to, as HF's select_best_resolution picks it: the most of the image's
    pixels kept, then the fewest padded."""
    best, most_kept, least_wasted = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (h, w), kept, wasted
    return best


def feature_rows(config: ModelConfig, height: int, width: int) -> np.ndarray:
    """i32[I]: for each embedding of an image of `height` x `width` pixels, in prompt order,
    its row in [the U tiles' features, tile by tile (U * P rows); image_newline]: the base's P
    features, then the grid's unpadded features row by row, each row followed by the
    newline (HF's pack_image_features)."""
    vision = config.option("vision")
    side = vision.image_size // vision.patch_size  # patches a tile's side
    best_h, best_w = best_resolution(height, width, config.option("image_grid_pinpoints"))
    tile_rows, tile_cols = best_h // vision.image_size, best_w // vision.image_size
    grid_h, grid_w = tile_rows * side, tile_cols * side  # features a side of the grid
    # HF's unpad_image: the rows (columns) of the grid the resized image does not reach, the
    # padding split evenly above and below (left and right).
    ys, xs = np.arange(grid_h), np.arange(grid_w)
    if width / height > grid_w / grid_h:
        pad = (grid_h - int(round(height * (grid_w / width), 7))) // 2
        ys = ys[pad : grid_h - pad]
    else:
        pad = (grid_w - int(round(width * (grid_h / height), 7))) // 2
        xs = xs[pad : grid_w - pad]
    y, x = np.meshgrid(ys, xs, indexing="ij")  # [H', W']
    tile = 1 + (y // side) * tile_cols + x // side  # the base is tile 0
    rows = tile * side * side + (y % side) * side + x % side
    newline = (1 + tile_rows * tile_cols) * side * side
    rows = np.concatenate([rows, np.full((len(ys), 1), newline)], axis=1)  # [H', W' + 1]
    return np.concatenate([np.arange(side * side), rows.reshape(-1)]).astype(np.int32)


def image_inputs(config: ModelConfig, outputs: dict) -> tuple[dict[str, np.ndarray], tuple]:
    """(what encode_images takes of one image, its (height, width) in pixels) from the image
    processor's outputs for that image alone: pixel_values [1, U, 3, S, S] and image_sizes
    [1, 2]."""
    pixels = np.asarray(outputs["pixel_values"], np.float32)
    sizes = np.asarray(outputs["image_sizes"])
    if pixels.ndim != 5 or pixels.shape[0] != 1 or sizes.shape != (1, 2):
        raise ValueError(
            f"the image processor gave pixel_values {pixels.shape} and image_sizes "
            f"{sizes.shape}, not one image's [1, U, 3, S, S] and [1, 2]"
        )
    height, width = (int(v) for v in sizes[0])
    vision = config.option("vision")
    best_h, best_w = best_resolution(height, width, config.option("image_grid_pinpoints"))
    num_tiles = 1 + (best_h // vision.image_size) * (best_w // vision.image_size)
    if pixels.shape[1:] != (num_tiles, 3, vision.image_size, vision.image_size):
        raise ValueError(
            f"the image processor gave tiles {pixels.shape[1:]} for a {height} x {width} image; "
            f"the model's image_grid_pinpoints and vision_config.image_size take "
            f"{(num_tiles, 3, vision.image_size, vision.image_size)}: the processor's "
            "image_grid_pinpoints and crop_size must be the model's"
        )
    data = {"pixel_values": pixels[0], "feature_rows": feature_rows(config, height, width)}
    return data, (height, width)


def image_tokens(config: ModelConfig, grid: tuple, tokenizer=None) -> list[int]:
    """The tokens in place of an image's placeholder, from its (height, width): one image token
    an embedding, as LlavaNextProcessor writes them."""
    return [config.option("image_token_id")] * len(feature_rows(config, *grid))


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    normalize_hf_config = staticmethod(_normalize)
    # The engine then reads the image processor alone, and writes each image's tokens from the
    # model's own config, so that a processor_config.json whose patch_size or
    # num_additional_image_tokens disagree with it cannot put the text out of step with the
    # features.
    image_inputs = staticmethod(image_inputs)
    image_tokens = staticmethod(image_tokens)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.image_newline = param((config.hidden_size,), jnp.dtype(config.dtype), ("embed",))

    def encode_images(self, pixel_values: jax.Array, feature_rows: jax.Array) -> jax.Array:
        """pixel_values f32[N, U, 3, S, S] (each image's tiles, the base first) and
        feature_rows i32[N, I] (`feature_rows`) -> each image's embeddings f32[N, I, D]."""
        n, u = pixel_values.shape[:2]
        tiles = super().encode_images(pixel_values.reshape(n * u, *pixel_values.shape[2:]))
        features = tiles.reshape(n, -1, tiles.shape[-1])  # [N, U * P, D]
        newline = jnp.broadcast_to(
            self.image_newline[...].astype(features.dtype), (n, 1, features.shape[-1])
        )
        features = jnp.concatenate([features, newline], axis=1)  # [N, U * P + 1, D]
        return jnp.take_along_axis(features, feature_rows[..., None], axis=1)

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        """The most embeddings one image takes: the base's, and those of the largest grid
        of image_grid_pinpoints with none unpadded, a newline after each row."""
        vision = config.option("vision")
        side = vision.image_size // vision.patch_size
        most = max(
            (h // vision.image_size * side) * (w // vision.image_size * side + 1)
            for h, w in config.option("image_grid_pinpoints")
        )
        return side * side + most

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        # transformers 4's name (save_pretrained writes it in 5 too), else 5's own module's.
        name = "image_newline" if weights.has("image_newline") else "model.image_newline"
        weights.tensor("image_newline", name)
        super().load_weights(config, weights)
