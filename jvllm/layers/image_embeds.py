"""The image embeddings a step's image tokens read in place of their token embeddings."""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ImageEmbeds:
    """Row t of `embeds` f32[T, W] (the model dtype) is token t's input (its first D columns)
    where `is_embed[t]` (bool[T]); every other token reads its token embedding. W is D, or
    more where a family carries more of each image token (Qwen3-VL's DeepStack features). A
    step of text has is_embed all False, so a model that takes images runs one executable a
    bucket either way."""

    embeds: jax.Array
    is_embed: jax.Array
    # i32[3, T]: each token's (temporal, height, width) rotary positions, for a model with
    # M-RoPE (Qwen2-VL); None: the step's positions.
    rope_positions: jax.Array | None = None

    def merge(self, x: jax.Array) -> jax.Array:
        """x f32[T, D] (the token embeddings) with the image tokens' rows replaced."""
        embeds = self.embeds[:, : x.shape[-1]].astype(x.dtype)
        return jnp.where(self.is_embed[:, None], embeds, x)

    def without_images(self) -> "ImageEmbeds":
        """The same arrays with no token reading them, and each token's rotary positions one
        on: a decode step's after this one's."""
        rope = None if self.rope_positions is None else self.rope_positions + 1
        return ImageEmbeds(self.embeds, jnp.zeros_like(self.is_embed), rope)
