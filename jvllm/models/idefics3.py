"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration):
a SigLIP tower over each image's tiles, a pixel-shuffle connector, and a Llama language model
that reads the tiles' embeddings in place of the prompt's image tokens.

The processor splits an image into tiles of the tower's size plus a global view, and writes
each tile's image tokens between marker tokens (`<fake_token_around_image><row_1_col_1>`):
the markers are ordinary prompt tokens, the image tokens take the embeddings in order.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import transformers

from jvllm.config import ModelConfig
from jvllm.layers.linear import Linear
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.siglip_vision import SiglipVisionTower
from jvllm.models.vit import vision_settings
from jvllm.models.weights import CheckpointWeights

# Tiles of the largest image the default processors make (SmolVLM's longest edge of 4 x 512
# pixels: 4 x 4 tiles and the global view): what the encoder budget is sized for by default.
# A larger image is still encoded, alone in its step.
_DEFAULT_MAX_TILES = 17


def image_inputs(config: ModelConfig, outputs: dict) -> tuple[dict[str, np.ndarray], tuple]:
    """(what encode_images takes of one image, its grid of tiles (rows, columns), 0 x 0 for an
    image not split) from the image processor's outputs for that image alone."""
    data = {k: outputs[k][0] for k in ("pixel_values", "pixel_attention_mask")}
    rows, cols = (int(np.asarray(outputs[k]).reshape(-1)[0]) for k in ("rows", "cols"))
    return data, (rows, cols)


def image_tokens(config: ModelConfig, grid: tuple, tokenizer) -> list[int]:
    """The tokens in place of an image's placeholder, as Idefics3Processor and SmolVLMProcessor
    write them: each tile's row-column marker and image tokens between
    <fake_token_around_image> markers, a new line after each row of tiles, then the global
    view's; an image not split has the global view alone. Its edges are special tokens, so it
    tokenizes alone as within the prompt."""
    vision, scale = config.option("vision"), config.option("scale_factor")
    image = "<image>" * (vision.num_patches // (scale * scale))
    rows, cols = grid
    text = "".join(
        "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image}" for c in range(cols))
        + "\n"
        for r in range(rows)
    )
    text += "\n" if rows else ""
    text += f"<fake_token_around_image><global-img>{image}<fake_token_around_image>"
    return tokenizer.encode(text, add_special_tokens=False)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    # The engine reads the image processor alone and writes the images' tokens itself:
    # SmolVLMProcessor needs torchvision (for video), which jvllm does not install.
    image_inputs = staticmethod(image_inputs)
    image_tokens = staticmethod(image_tokens)
    image_processor_kwargs: ClassVar[dict] = {"return_row_col_info": True}

    @staticmethod
    def normalize_hf_config(cfg: dict) -> dict:
        text = dict(cfg.get("text_config") or {})
        model_type = text.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(
                f"text_config.model_type={model_type!r} is not supported in an Idefics3 / "
                "SmolVLM checkpoint; allowed: 'llama'"
            )
        text["architectures"] = ["LlamaForCausalLM"]
        text = LlamaForCausalLM.normalize_hf_config(text)
        text["architectures"] = cfg.get("architectures") or ["Idefics3ForConditionalGeneration"]
        for name in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if cfg.get(name) is not None:
                text[name] = cfg[name]
        vision_config = {
            **transformers.Idefics3VisionConfig().to_dict(),
            **(cfg.get("vision_config") or {}),
        }
        vision = vision_settings(vision_config, -1)
        scale = cfg.get("scale_factor", 2)
        side = vision.image_size // vision.patch_size
        if not isinstance(scale, int) or scale < 1 or side % scale:
            raise ValueError(
                f"scale_factor={scale!r} must be an int >= 1 that divides the tower's "
                f"{side} patches a side"
            )
        image_token_id = cfg.get("image_token_id")
        if not isinstance(image_token_id, int):
            raise TypeError(f"image_token_id must be an int, got {image_token_id!r}")
        text["options"] = {
            **text.get("options", {}),
            "vision": vision,
            "image_token_id": image_token_id,
            "scale_factor": scale,
        }
        return text

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        vision = config.option("vision")
        scale = config.option("scale_factor")
        self.vision = SiglipVisionTower(vision, jnp.dtype(config.dtype))
        width = vision.hidden_size * scale * scale
        self.connector = Linear(
            width, config.hidden_size, ("embed", "embed"), dtype=jnp.dtype(config.dtype)
        )

    def encode_images(self, pixel_values: jax.Array, pixel_attention_mask: jax.Array) -> jax.Array:
        """pixel_values f32[N, U, 3, S, S] (U tiles an image, the global view last) and
        pixel_attention_mask bool[N, U, S, S] (a tile's real pixels) -> each image's
        embeddings f32[N, U * P / s^2, D], its tiles' in order."""
        n, u = pixel_values.shape[:2]
        features = self.vision(
            pixel_values.reshape(n * u, *pixel_values.shape[2:]),
            pixel_attention_mask.reshape(n * u, *pixel_attention_mask.shape[2:]).astype(bool),
        )
        features = _pixel_shuffle(features, self.config.option("scale_factor"))
        embeds = self.connector(features)  # [N * U, P / s^2, D]
        return embeds.reshape(n, -1, embeds.shape[-1])

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        """The embeddings of the largest image the default processors make (see
        _DEFAULT_MAX_TILES)."""
        vision, scale = config.option("vision"), config.option("scale_factor")
        return _DEFAULT_MAX_TILES * vision.num_patches // (scale * scale)

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        vision = config.option("vision")
        SiglipVisionTower.load_weights(weights, "vision", "model.vision_model.", vision.num_layers)
        weights.tensor("connector.weight", "model.connector.modality_projection.proj.weight")
        weights.set_layers(0, config.num_layers)
        super().load_weights(config, weights, prefix="model.text_model.")


def _pixel_shuffle(x: jax.Array, scale: int) -> jax.Array:
    """f32[N, P, C] -> f32[N, P / s^2, C * s^2]: each s x s block of neighbouring patches as one
    row, in the order of HF's Idefics3Connector.pixel_shuffle."""
    n, p, c = x.shape
    side = round(p**0.5)
    x = x.reshape(n, side, side // scale, c * scale)  # s patches of a row together
    x = x.transpose(0, 2, 1, 3).reshape(n, side // scale, side // scale, c * scale * scale)
    return x.transpose(0, 2, 1, 3).reshape(n, p // (scale * scale), c * scale * scale)
