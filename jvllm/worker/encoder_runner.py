"""The vision encoder's side of the runner: encodes the images the scheduler names, keeps
their embeddings by content hash until its encoder cache evicts them
(core/encoder_cache_manager.py), and lays out each step's image-token rows.

The embeddings are kept on the host: a step's rows are gathered into one [T, D] array, sent
with the step's other inputs, so the step compiles once a bucket whatever its images."""

import dataclasses
import functools
import time
from collections import defaultdict

import jax
import numpy as np

from jvllm.config import ModelConfig
from jvllm.core.multimodal import MultiModalFeature, overlapping
from jvllm.core.request import Request
from jvllm.layers.image_embeds import ImageEmbeds
from jvllm.logger import init_logger
from jvllm.models.model import encode_images
from jvllm.worker.step_inputs import StepInputs

logger = init_logger(__name__)

# Images encoded in one call at most; a batch is padded to a power of two up to it, so each
# image shape compiles at most log2(8) + 1 executables.
MAX_IMAGES_PER_CALL = 8


class EncoderRunner:
    def __init__(self, config: ModelConfig):
        # An image token's row: the model's width, or a family's wider one (ImageEmbeds).
        self.embed_width = config.option("image_embed_width", config.hidden_size)
        self.dtype = np.dtype(jax.numpy.dtype(config.dtype))
        self._encode = jax.jit(functools.partial(encode_images, config=config))
        # M-RoPE (Qwen2-VL): every step carries each token's three rotary positions.
        self.has_rope_positions = config.option("mrope_section") is not None
        # Gemma 3: the attention reads each image token's image (attention/image_ahead.py).
        self.has_image_groups = bool(config.option("bidirectional_images"))
        self.cache: dict[str, np.ndarray] = {}  # hash -> [I, D]
        self.num_images_encoded = 0
        self.encode_seconds = 0.0

    def run(self, params, scheduler_output) -> None:
        """Drop the embeddings the scheduler's encoder cache evicted, then encode the images
        it scheduled for this step (a SchedulerOutput)."""
        self.drop(scheduler_output.freed_encoder_hashes)
        scheduled = scheduler_output.scheduled_encoder_inputs
        requests = scheduler_output.scheduled_requests
        self.encode(
            params, [r.mm_features[i] for r in requests for i in scheduled.get(r.request_id, ())]
        )

    def with_images(self, inputs: StepInputs, requests: list[Request], counts: list[int]):
        """A step's inputs with its image tokens' embeddings (and M-RoPE positions), and, for a
        model whose image tokens attend to their whole image, each token's image."""
        inputs = dataclasses.replace(
            inputs, mm=self.step_embeds(requests, counts, inputs.positions)
        )
        if not self.has_image_groups:
            return inputs
        groups = image_groups(requests, counts, len(inputs.positions))
        return dataclasses.replace(
            inputs, attn=dataclasses.replace(inputs.attn, image_groups=groups)
        )

    def drop(self, hashes: list[str]) -> None:
        for key in hashes:
            self.cache.pop(key, None)

    def encode(self, params, features: list[MultiModalFeature]) -> None:
        """Encode `features` (each image once), in batches of images of one shape."""
        start = time.perf_counter()
        groups: dict[tuple, list[MultiModalFeature]] = defaultdict(list)
        for f in {f.identifier: f for f in features if f.identifier not in self.cache}.values():
            groups[tuple((k, v.shape) for k, v in sorted(f.data.items()))].append(f)
        for group in groups.values():
            for i in range(0, len(group), MAX_IMAGES_PER_CALL):
                self._encode_batch(params, group[i : i + MAX_IMAGES_PER_CALL])
        if groups:
            seconds = time.perf_counter() - start
            self.encode_seconds += seconds
            logger.debug("encoded %d images in %.3fs", sum(map(len, groups.values())), seconds)

    def _encode_batch(self, params, batch: list[MultiModalFeature]) -> None:
        size = 1 << (len(batch) - 1).bit_length()  # padded with the first image
        padded = batch + [batch[0]] * (size - len(batch))
        data = {k: np.stack([f.data[k] for f in padded]) for k in batch[0].data}
        embeds = np.asarray(self._encode(params, data)).astype(self.dtype)  # [N, I, width]
        for f, rows in zip(batch, embeds):
            # A family may pad an image's arrays to fewer shapes: its padding's rows come last.
            if rows.shape[0] < f.num_embeds:
                raise ValueError(
                    f"the encoder gave {rows.shape[0]} embeddings for an image with "
                    f"{f.num_embeds} placeholder tokens"
                )
            self.cache[f.identifier] = rows[: f.num_embeds]
        self.num_images_encoded += len(batch)

    def step_embeds(
        self, requests: list[Request], counts: list[int], positions: np.ndarray
    ) -> ImageEmbeds:
        """The ImageEmbeds (numpy) of a step whose request r computes `counts[r]` tokens from
        its num_computed_tokens, laid out as prepare_step_inputs lays out the tokens
        (`positions` i32[T], the step's)."""
        num_tokens = len(positions)
        embeds, is_embed = None, None
        t = 0
        for request, n in zip(requests, counts):
            start = request.num_computed_tokens
            for i in overlapping(request.mm_features, start, start + n):
                if embeds is None:
                    embeds = np.zeros((num_tokens, self.embed_width), self.dtype)
                    is_embed = np.zeros(num_tokens, bool)
                feature = request.mm_features[i]
                rows, tokens = _image_rows(feature, start, start + n)
                embeds[t + tokens] = self.cache[feature.identifier][rows]
                is_embed[t + tokens] = True
            t += n
        if embeds is None:
            embeds, is_embed = _no_images(num_tokens, self.embed_width, self.dtype)
        if not self.has_rope_positions:
            return ImageEmbeds(embeds, is_embed)
        return ImageEmbeds(embeds, is_embed, _rope_positions(requests, counts, positions))


def _image_rows(feature: MultiModalFeature, start: int, end: int):
    """(the image's embedding rows, their tokens counted from `start`) for the image's
    positions within `start .. end - 1` that take an embedding."""
    ph = feature.placeholder
    lo, hi = max(start, ph.offset), min(end, ph.end)
    mask = np.ones(ph.length, bool) if ph.is_embed is None else np.asarray(ph.is_embed)
    row_of = np.cumsum(mask) - 1  # [length] each position's row, where it has one
    offsets = np.arange(lo, hi) - ph.offset
    offsets = offsets[mask[offsets]]
    return row_of[offsets], offsets + ph.offset - start


def image_groups(requests: list[Request], counts: list[int], num_tokens: int) -> np.ndarray:
    """i32[T]: the image of each of a step's image tokens (numbered within the step), -1 for
    every other token, laid out as prepare_step_inputs lays out the tokens."""
    groups = np.full(num_tokens, -1, np.int32)
    t, image = 0, 0
    for request, n in zip(requests, counts):
        start = request.num_computed_tokens
        for i in overlapping(request.mm_features, start, start + n):
            _, tokens = _image_rows(request.mm_features[i], start, start + n)
            groups[t + tokens] = image
            image += 1
        t += n
    return groups


def _rope_positions(requests: list[Request], counts: list[int], positions: np.ndarray):
    """i32[3, T]: each token's M-RoPE positions: a prompt token's as its request computed them,
    a later one's its index + the request's rope_delta, padding's its `positions`."""
    rope = np.repeat(positions[None, :].astype(np.int32), 3, axis=0)
    t = 0
    for request, n in zip(requests, counts):
        if request.rope_positions is not None:
            index = np.arange(request.num_computed_tokens, request.num_computed_tokens + n)
            in_prompt = index < request.rope_positions.shape[1]
            rope[:, t : t + n] = index + request.rope_delta
            rope[:, t : t + n][:, in_prompt] = request.rope_positions[:, index[in_prompt]]
        t += n
    return rope


@functools.cache
def _no_images(num_tokens: int, width: int, dtype: np.dtype) -> tuple:
    """A step of text's embeddings and mask: one read-only pair of arrays a bucket."""
    embeds = np.zeros((num_tokens, width), dtype)
    is_embed = np.zeros(num_tokens, bool)
    embeds.flags.writeable = is_embed.flags.writeable = False
    return embeds, is_embed
