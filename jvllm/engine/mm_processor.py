"""Prompts with images, at the edge: the model's HF processor turns each image into the arrays
its encoder reads and the placeholder tokens it fills, as vLLM's multimodal processor does.

A prompt names each image's place with one placeholder token (the processor's image token,
e.g. "<image>"), in its text or its token ids; each is replaced by the tokens the processor
gives that image alone (LLaVA's one a patch; other families add markers around tiles), so a
text prompt and a token-id prompt become the same token ids. Each image's identity is the hash
of its processed arrays: the key of the encoder cache, and of the prefix cache's blocks that
hold its tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from jvllm.config import ModelConfig
from jvllm.core.engine_config import MultiModalConfig
from jvllm.core.multimodal import MultiModalFeature, PlaceholderRange
from jvllm.logger import init_logger
from jvllm.models.model import takes_images
from jvllm.models.registry import SUPPORTED_ARCHITECTURES, model_class

logger = init_logger(__name__)

# Processor outputs that are the text's, not an image's.
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def image_architectures() -> tuple[str, ...]:
    """The registered families that take images, for error messages."""
    return tuple(a for a in SUPPORTED_ARCHITECTURES if hasattr(model_class(a), "encode_images"))


def check_no_images(prompt, why: str) -> None:
    """A ValueError when a prompt dict brings images that its engine cannot take."""
    if isinstance(prompt, Mapping) and _has_images(prompt.get("multi_modal_data")):
        raise ValueError(f"multi_modal_data was given, but {why}")


def _has_images(data) -> bool:
    """Whether multi_modal_data names anything: None and empty lists name nothing."""
    if not isinstance(data, Mapping):
        return data is not None
    return any(
        v is not None and not (isinstance(v, (list, tuple)) and not v) for v in data.values()
    )


@dataclasses.dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt with images, ready for a Request: `rope_positions` i32[3, L] and `rope_delta`
    are a model with M-RoPE's (the families' mrope_positions), else None and 0."""

    text: str | None
    token_ids: list[int]
    features: list[MultiModalFeature]
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0


class MultiModalProcessor:
    def __init__(
        self, model_path: str, config: ModelConfig, mm_config: MultiModalConfig, tokenizer=None
    ):
        self.model_path = model_path
        self.config = config
        self.family = model_class(config.architecture)
        self.image_token_id = config.option("image_token_id")
        # What a prompt puts where an image goes: the image token itself, or a marker the
        # processor expands (Gemma 3's <start_of_image>).
        self.placeholder_id = config.option("image_placeholder_id", self.image_token_id)
        self.limit = (mm_config.limit_mm_per_prompt or {}).get("image")
        self.kwargs = dict(mm_config.mm_processor_kwargs or {})
        self._processor = None
        self.writes_image_tokens = hasattr(self.family, "image_tokens")
        self._tokenizer = tokenizer

    @property
    def processor(self):
        """The model directory's HF processor, loaded on the first image; for a family that
        writes its images' tokens itself (`image_tokens`), its image processor alone: its
        full processor would need torchvision for video."""
        if self._processor is None:
            import transformers

            auto = transformers.AutoProcessor
            if self.writes_image_tokens:
                auto = transformers.AutoImageProcessor
            try:
                self._processor = auto.from_pretrained(self.model_path)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"the model at {self.model_path!r} takes images, but its processor could "
                    f"not be loaded ({e}); the directory needs the processor's files "
                    "(processor_config.json or preprocessor_config.json)"
                ) from e
            if not self.writes_image_tokens and not hasattr(self._processor, "image_processor"):
                raise ValueError(
                    f"the processor at {self.model_path!r} ({type(self._processor).__name__}) "
                    "has no image processor"
                )
        return self._processor

    @property
    def image_token(self) -> str:
        """The placeholder a prompt's text puts where each image goes."""
        tokenizer = self._tokenizer if self.writes_image_tokens else self.processor.tokenizer
        if tokenizer is None:
            raise ValueError("this model ships no tokenizer: pass prompts as token ids")
        return tokenizer.convert_ids_to_tokens(self.placeholder_id)

    def process(self, prompt: Mapping, tokenizer) -> ProcessedPrompt:
        """A prompt dict with `multi_modal_data`: its token ids with each image's placeholder
        expanded, and its images; ValueError / TypeError naming what is wrong, before
        anything enters the engine."""
        images = _images(prompt.get("multi_modal_data") or {})
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(
                f"the prompt has {len(images)} images, more than limit_mm_per_prompt allows "
                f"({self.limit}); raise limit_mm_per_prompt={{'image': k}}"
            )
        kwargs = {**self.kwargs, **(prompt.get("mm_processor_kwargs") or {})}
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            token_ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(text, str) and text:
            if tokenizer is None:
                raise ValueError("this model ships no tokenizer: pass the prompt as token ids")
            token_ids = tokenizer.encode(text)
        else:
            raise ValueError("a prompt dict needs a non-empty 'prompt' or 'prompt_token_ids'")
        if not images:  # e.g. {"image": None}: a prompt of text
            return ProcessedPrompt(text if isinstance(text, str) else None, token_ids, [])
        processed = [self._expand(image, kwargs) for image in images]
        expansions = [p[0] for p in processed]
        places = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        if (
            len(places) == len(images)
            and "prompt_token_ids" not in prompt
            and (not self.writes_image_tokens)
        ):
            # The processor on the whole text, as HF users run it: an expansion that begins
            # or ends with text (Gemma 3's blank lines) tokenizes with its neighbours.
            out, offsets, expansions = self._whole_text(text, images, expansions, kwargs)
        elif len(places) == len(images):  # one placeholder an image: expand each
            out, offsets, last = [], [], 0
            for place, expansion in zip(places, expansions):
                out += token_ids[last:place]
                offsets.append(len(out))
                out += expansion
                last = place + 1
            out += token_ids[last:]
        else:  # the processor's tokens already in place (a prompt a processor made)
            out, offsets = token_ids, _expanded_offsets(token_ids, expansions, self.image_token_id)
            if offsets is None:
                raise ValueError(
                    f"the prompt has {len(places)} image placeholders ({self.image_token!r}, "
                    f"token id {self.placeholder_id}) for {len(images)} images: put one where "
                    "each image goes (LLM.chat and the chat API add them from the messages' "
                    "image parts), or each image's tokens as its processor writes them"
                )
        features = []
        for offset, expansion, (_, data, grid) in zip(offsets, expansions, processed):
            is_embed = tuple(t == self.image_token_id for t in expansion)
            placeholder = PlaceholderRange(
                offset, len(expansion), None if all(is_embed) else is_embed
            )
            features.append(
                MultiModalFeature("image", _content_hash(data), placeholder, data, grid)
            )
        text = text if isinstance(text, str) else None
        if not hasattr(self.family, "mrope_positions"):
            return ProcessedPrompt(text, out, features)
        positions, delta = self.family.mrope_positions(self.config, out, [f.grid for f in features])
        return ProcessedPrompt(text, out, features, positions, delta)

    def _whole_text(self, text: str, images: list, expansions: list[list[int]], kwargs: dict):
        """(the processor's token ids of the whole text with its images, where each image's
        tokens start, each image's tokens): an image's from its first image token to its last,
        the markers between them included (and so its share of `expansions`' image tokens)."""
        try:
            out = self.processor(text=[text], images=images, return_tensors="np", **kwargs)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"the model's processor could not take the prompt: {e}") from e
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        image_places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        counts = [expansion.count(self.image_token_id) for expansion in expansions]
        if len(image_places) != sum(counts):
            raise ValueError(
                f"the model's processor wrote {len(image_places)} image tokens for images of "
                f"{sum(counts)}: is the prompt's text holding image tokens of its own?"
            )
        offsets, spans, used = [], [], 0
        for count in counts:
            first, last = image_places[used], image_places[used + count - 1]
            offsets.append(first)
            spans.append(ids[first : last + 1])
            used += count
        return ids, offsets, spans

    def _expand(self, image, kwargs: dict) -> tuple[list[int], dict[str, np.ndarray], tuple]:
        """(the tokens the processor puts for `image` in place of its placeholder, the arrays
        the model's encoder takes, its patch grid or None)."""
        processor = self.processor
        try:
            if self.writes_image_tokens:
                extra = getattr(self.family, "image_processor_kwargs", {})
                extra = extra(self.config) if callable(extra) else extra
                out = processor(images=[image], return_tensors="np", **extra, **kwargs)
            else:
                out = processor(
                    text=[self.image_token], images=[image], return_tensors="np", **kwargs
                )
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"the model's processor could not take the image: {e}") from e
        outputs = {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS}
        if self.writes_image_tokens:  # the family's own images' layout and tokens
            data, grid = self.family.image_inputs(self.config, outputs)
            return self.family.image_tokens(self.config, grid, self._tokenizer), data, grid
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        # What the tokenizer adds around any text (BOS), not part of the image's tokens.
        extra = processor.tokenizer("", add_special_tokens=True)["input_ids"]
        if extra and ids[: len(extra)] == list(extra):
            ids = ids[len(extra) :]
        data = {}
        for key, value in outputs.items():
            if value.shape[:1] != (1,):
                raise ValueError(
                    f"the processor's {key!r} has shape {value.shape}, not one image's"
                )
            data[key] = value[0]
        return ids, data, None


def _expanded_offsets(
    token_ids: list[int], expansions: list[list[int]], image_token_id: int
) -> list[int] | None:
    """Where each image's tokens (`expansions`, in order) start in a prompt that already
    holds them, every image token of the prompt within one; None when it does not."""
    offsets, i = [], 0
    for expansion in expansions:
        while i < len(token_ids) and token_ids[i : i + len(expansion)] != expansion:
            if token_ids[i] == image_token_id:
                return None  # an image token outside every image's tokens
            i += 1
        if i >= len(token_ids):
            return None
        offsets.append(i)
        i += len(expansion)
    if image_token_id in token_ids[i:]:
        return None
    return offsets


def _images(data: Mapping) -> list[Any]:
    """The prompt's images (PIL images) from multi_modal_data, with errors naming the part."""
    if not isinstance(data, Mapping):
        raise TypeError(f"multi_modal_data must be a dict like {{'image': img}}, got {data!r}")
    others = [k for k in data if k != "image" and data[k] is not None]
    if others:
        raise ValueError(
            f"multi_modal_data[{others[0]!r}] is not supported: only 'image' (video and audio "
            "are not supported yet)"
        )
    images = data.get("image")
    images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(
                f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                f"{type(image).__name__}"
            )
    return [image.convert("RGB") if image.mode != "RGB" else image for image in images]


def _content_hash(data: dict[str, np.ndarray]) -> str:
    """SHA-256 of the image's processed arrays (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for key in sorted(data):
        value = np.ascontiguousarray(data[key])
        digest.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def make_mm_processor(
    model_path: str | None, config: ModelConfig, mm_config: MultiModalConfig, tokenizer=None
) -> MultiModalProcessor | None:
    """The engine's processor of images, None for a model that takes none."""
    if not takes_images(config):
        return None
    return MultiModalProcessor(model_path, config, mm_config, tokenizer)
