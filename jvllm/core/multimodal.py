"""A request's images as the scheduler sees them: where each image's tokens lie in the prompt,
the content hash that names its encoder output, and the processor's arrays the encoder reads
(vLLM's MultiModalFeatureSpec and PlaceholderRange)."""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt positions `offset .. offset + length - 1` belong to one image. `is_embed` marks
    which of them take an embedding of the image (None: all of them); the others are the
    processor's markers around and between tiles, ordinary tokens of the prompt."""

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)


@dataclass(frozen=True, eq=False)
class MultiModalFeature:
    """One image of a request. `identifier`: the hash of what the encoder reads (the
    processor's output), the key of the encoder cache and the prefix cache's extra key of the
    blocks that hold its tokens; `data`: the processor's arrays for this image alone (numpy),
    what the model's encoder takes."""

    modality: str
    identifier: str
    placeholder: PlaceholderRange
    data: dict[str, Any]
    grid: tuple[int, ...] | None = None  # (t, h, w) patches, where positions need it (M-RoPE)

    @property
    def num_embeds(self) -> int:
        return self.placeholder.num_embeds


def overlapping(features, start: int, end: int) -> list[int]:
    """Indices of the features whose placeholders meet positions `start .. end - 1`."""
    return [
        i
        for i, f in enumerate(features)
        if f.placeholder.offset < end and start < f.placeholder.end
    ]
