"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration), images only: a vision tower (models/qwen2_vl_vision.py)
and a Qwen2 language model with M-RoPE.

M-RoPE: each token has three rotary positions, (temporal, height, width). A text token's three
are equal, one past the previous token's largest; an image token's are its merged patch's
(frame, row, column) plus the position the image starts at, and the text after an image
continues from that start plus the image's larger side in merged patches. The host computes
a prompt's positions (`mrope_positions`) and the step's `mm.rope_positions` carries them; a
token after the prompt, at index i, has all three at i + delta (the prompt's `delta`), so a
decode step's M-RoPE is plain rotary at position i + delta.

The step is the text model's, as LLaVA's: the runner encodes each image once
(`encode_images`), and the step's `mm` puts the embeddings of its image tokens in place of
their token embeddings before the first layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.layers.attention import AttentionFn
from jvllm.layers.rotary import mrope_cos_sin
from jvllm.models.llama import LlamaForCausalLM
from jvllm.models.qwen2_vl_vision import QwenVisionTower, vision_settings
from jvllm.models.weights import CheckpointWeights

_QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
_ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": _QWEN2_5_VL}
_DEFAULT_IMAGE_TOKEN_ID = 151655


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a Qwen-VL generation's config.json means where it leaves a field out, and how its
    text model and tower read."""

    text_defaults: dict  # its text config class's defaults
    rope_theta: float
    mrope_section: tuple[int, int, int]
    text_model_type: str  # the text family's model_type
    text_architecture: str  # the text family's architecture
    text_normalize: Callable[[dict], dict]  # its config reading
    keeps_head_dim: bool  # False: HF's attention takes hidden_size / heads
    # The most pixels the image processor resizes an image to (the released checkpoints'
    # preprocessor_config.json), unless the config (e.g. through hf_overrides) gives
    # "max_pixels".
    max_pixels: int
    vision: Callable[[dict, str], object]  # (vision_config, architecture) -> its settings


QWEN2_VL = Generation(
    # Qwen2VLTextConfig's defaults (its and Qwen2.5-VL's).
    text_defaults={
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    rope_theta=1_000_000.0,
    mrope_section=(16, 24, 24),
    text_model_type="qwen2",
    text_architecture="Qwen2ForCausalLM",
    text_normalize=LlamaForCausalLM.normalize_hf_config,
    keeps_head_dim=False,
    max_pixels=12_845_056,  # 16384 merged patches of 28 x 28 pixels
    vision=lambda vc, architecture: vision_settings(vc, architecture == _QWEN2_5_VL),
)


def normalize_vl(cfg: dict, generation: Generation = QWEN2_VL) -> dict:
    """A Qwen-VL config.json, flat (transformers 4) or with text_config (transformers 5), as
    its text model's, the vision tower and M-RoPE in options."""
    architecture = (cfg.get("architectures") or [None])[0]
    architecture = architecture or _ARCHITECTURES[cfg.get("model_type")]
    outer = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = {**generation.text_defaults, **outer, **(cfg.get("text_config") or {})}
    for name in ("eos_token_id", "bos_token_id"):  # the whole model's, as LLaVA's
        if cfg.get(name) is not None:
            text[name] = cfg[name]
    text["tie_word_embeddings"] = bool(
        cfg.get("tie_word_embeddings") or (cfg.get("text_config") or {}).get("tie_word_embeddings")
    )
    if not generation.keeps_head_dim:
        text.pop("head_dim", None)
    sections = generation.mrope_section
    has_theta = "rope_theta" in text
    for key in ("rope_scaling", "rope_parameters"):
        rope = dict(text.get(key) or {})
        sections = tuple(rope.pop("mrope_section", sections))
        rope.pop("mrope_interleaved", None)  # Qwen3-VL's, which HF's model always is
        if rope.get("rope_type", rope.get("type")) == "mrope":  # HF reads it as the default
            rope.pop("type", None)
            rope["rope_type"] = "default"
        has_theta = has_theta or "rope_theta" in rope
        text[key] = rope or None
    if not has_theta:
        text["rope_theta"] = generation.rope_theta
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if any(not isinstance(s, int) or s < 0 for s in sections) or 2 * sum(sections) != head_dim:
        raise ValueError(
            f"rope_scaling.mrope_section={list(sections)} must be three counts of rotary pairs "
            f"summing to head_dim / 2 = {head_dim // 2}"
        )
    text["model_type"] = generation.text_model_type
    text["architectures"] = [generation.text_architecture]
    text = generation.text_normalize(text)
    text["architectures"] = [architecture]
    vision = generation.vision(cfg.get("vision_config") or {}, architecture)
    if vision.out_size != text["hidden_size"]:
        raise ValueError(
            f"the vision tower's output width {vision.out_size} must equal the text model's "
            f"hidden_size {text['hidden_size']}"
        )
    image_token_id = cfg.get("image_token_id", _DEFAULT_IMAGE_TOKEN_ID)
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
        raise TypeError(f"image_token_id must be an int, got {image_token_id!r}")
    max_pixels = cfg.get("max_pixels", generation.max_pixels)
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels <= 0:
        raise ValueError(f"max_pixels must be a positive int, got {max_pixels!r}")
    text["options"] = {
        **text.get("options", {}),
        "vision": vision,
        "image_token_id": image_token_id,
        "mrope_section": sections,
        "max_pixels": max_pixels,
    }
    return text


def image_arrays(config: ModelConfig, grid_thw: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays `encode_images` takes beside pixel_values for one image of grid_thw (t, h, w
    in patches, the processor's image_grid_thw row), each per patch: vision_positions i32[P, 2],
    attention_segments i32[P], and for Qwen2.5-VL window_segments i32[P] (see
    qwen2_vl_vision.vision_arrays)."""
    return config.option("vision").arrays(grid_thw)


def image_num_embeds_for(config: ModelConfig, grid_thw) -> int:
    """The embeddings (and prompt tokens) of an image of grid_thw (t, h, w): one a group of
    merge x merge patches."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // config.option("vision").group_size


def mrope_positions(
    config: ModelConfig, token_ids: list[int], grids: list[tuple[int, int, int]]
) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions i32[3, L] and its delta, as HF's get_rope_index for a prompt
    of text and images: `grids` holds each image's (t, h, w) in patches, in prompt order, and
    each image is the next t * h * w / merge^2 image tokens. A token after the prompt at index i
    has position i + delta in all three streams (delta: the largest position + 1 - L)."""
    image_token_id = config.option("image_token_id")
    m = config.option("vision").merge_size
    token_ids = np.asarray(token_ids)
    is_image = token_ids == image_token_id
    positions = np.zeros((3, len(token_ids)), np.int64)
    start, i = 0, 0  # the next text position, the next token
    images = iter(grids)
    while i < len(token_ids):
        if not is_image[i]:
            end = i + int(np.argmax(is_image[i:])) if is_image[i:].any() else len(token_ids)
            positions[:, i:end] = start + np.arange(end - i)
            start, i = start + end - i, end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"the prompt has more image tokens than {len(grids)} images take")
        t, h, w = (int(v) for v in grid)
        num_tokens = t * (h // m) * (w // m)
        if not is_image[i : i + num_tokens].all() or i + num_tokens > len(token_ids):
            raise ValueError(
                f"image {(t, h, w)} takes {num_tokens} image tokens; the prompt has fewer there"
            )
        # Each merged patch's (frame, row, column), frame by frame in raster order.
        cells = np.indices((t, h // m, w // m)).reshape(3, -1)
        positions[:, i : i + num_tokens] = start + cells
        start += max(h, w) // m
        i += num_tokens
    if next(images, None) is not None:
        raise ValueError(f"the prompt's image tokens take fewer than its {len(grids)} images")
    delta = int(positions.max()) + 1 - len(token_ids) if len(token_ids) else 0
    return positions.astype(np.int32), delta


# Patches an image's arrays are padded to at least: each image size would otherwise compile
# the tower anew; padded to a power of two, they compile a few shapes (at most 2x the work).
_MIN_PADDED_PATCHES = 64


def image_inputs(config: ModelConfig, outputs: dict) -> tuple[dict[str, np.ndarray], tuple]:
    """(what encode_images takes of one image, its grid (t, h, w)) from the processor's outputs
    for that image alone: its pixel_values rows [P, K] and image_grid_thw [1, 3]. The rows are
    padded to a power of two with patches of segment -1, which no real patch attends to; the
    padding's embeddings come last, and the engine drops them."""
    grid = tuple(int(v) for v in np.asarray(outputs["image_grid_thw"])[0])
    data = {
        "pixel_values": np.asarray(outputs["pixel_values"], np.float32),
        **image_arrays(config, np.asarray(grid)),
    }
    num_patches = data["pixel_values"].shape[0]
    pad = max(_MIN_PADDED_PATCHES, 1 << (num_patches - 1).bit_length()) - num_patches
    fill = {"attention_segments": -1, "window_segments": -1}
    return {
        key: np.pad(
            value, [(0, pad)] + [(0, 0)] * (value.ndim - 1), constant_values=fill.get(key, 0)
        )
        for key, value in data.items()
    }, grid


def image_tokens(config: ModelConfig, grid: tuple, tokenizer=None) -> list[int]:
    """The tokens in place of an image's placeholder: one image token an embedding, as
    Qwen2VLProcessor writes them (the prompt holds the vision start and end markers)."""
    return [config.option("image_token_id")] * image_num_embeds_for(config, grid)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    normalize_hf_config = staticmethod(normalize_vl)
    mrope_interleaved = False  # Qwen3-VL's pairs alternate streams (rotary.mrope_cos_sin)
    tower = QwenVisionTower
    image_inputs = staticmethod(image_inputs)
    image_tokens = staticmethod(image_tokens)
    image_arrays = staticmethod(image_arrays)
    image_num_embeds_for = staticmethod(image_num_embeds_for)
    mrope_positions = staticmethod(mrope_positions)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.visual = self.tower(config.option("vision"), jnp.dtype(config.dtype))

    def __call__(self, kv_cache, token_ids, positions, metadata, attn: AttentionFn, mm=None):
        """token_ids i32[T], positions i32[T], mm: the step's image embeddings and M-RoPE
        positions (None: a step of text, each token's three positions its `positions`) ->
        (post-norm hidden f32[T, D], kv_cache)."""
        x = self.embed_tokens(token_ids)
        rope_positions = None
        if mm is not None:
            x = mm.merge(x)
            rope_positions = getattr(mm, "rope_positions", None)  # i32[3, T]
        if rope_positions is None:  # three equal streams: plain rotary
            return self.decode(kv_cache, x, positions, metadata, attn)
        config = self.config
        sections = config.option("mrope_section")
        cos_sin = mrope_cos_sin(rope_positions, config, sections, self.mrope_interleaved)
        after_layer = self.after_layer(mm)
        return self.decode(kv_cache, x, positions, metadata, attn, cos_sin, after_layer)

    def after_layer(self, mm):
        """What runs after each layer in a step with images (run_rotary_layers): nothing
        (None); Qwen3-VL's DeepStack."""

    def encode_images(self, pixel_values: jax.Array, **arrays: jax.Array) -> jax.Array:
        """A batch of images of P patches each: pixel_values f32[N, P, K] (the processor's
        rows of each image) and image_arrays' arrays stacked on N -> each image's embeddings
        f32[N, P / merge^2, D] (Qwen3-VL's wider: its DeepStack features too)."""
        return self.visual(pixel_values, **arrays)

    @staticmethod
    def image_num_embeds(config: ModelConfig) -> int:
        """The most embeddings one image takes: the image processor resizes an image to at
        most max_pixels pixels (the option, else the generation's released processors'), in
        sides that are multiples of patch_size * merge_size, one embedding each such square."""
        vision = config.option("vision")
        return config.option("max_pixels") // (vision.patch_size * vision.merge_size) ** 2

    @classmethod
    def load_weights(cls, config: ModelConfig, weights: CheckpointWeights) -> None:
        # save_pretrained (transformers 4, and 5 converting back) writes "model.layers.*" and
        # "visual.*"; transformers 5's own modules name them "model.language_model.*" and
        # "model.visual.*".
        if weights.has("model.language_model.norm.weight"):
            text, vision = "model.language_model.", "model.visual."
        else:
            text, vision = "model.", "visual."
        cls.tower.load_weights(weights, config.option("vision"), "visual", vision)
        weights.set_layers(0, config.num_layers)
        super().load_weights(config, weights, prefix=text, lm_head="lm_head.weight")


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: its tower's RMSNorms, gated MLPs and windowed layers come with the
    settings (qwen2_vl_vision.vision_settings); the rest is Qwen2-VL's."""
