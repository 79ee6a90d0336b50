"""The shapes of a model runner's steps, fixed by its configs before any array exists: the
buckets its steps are padded to (buckets.py), and what each step's inputs hold besides its
bucket (StepLayout: the block tables' padded width, the KV groups' tables, the drafts'
positions, the images' embeddings), which every executable is lowered for; and the attention
that reads steps laid out so."""

import math

from jvllm.attention.backends import get_attention, in_kv_groups
from jvllm.attention.page_walk import pages_per_chunk
from jvllm.config import ModelConfig
from jvllm.core.engine_config import RunnerConfig
from jvllm.core.kv_groups import KVCacheGroups
from jvllm.models.model import image_num_embeds
from jvllm.worker.buckets import MIXED_TILE_Q, SPECULATIVE_MIN_TOKENS, BucketSpec
from jvllm.worker.encoder_runner import EncoderRunner
from jvllm.worker.step_compiler import StepLayout


def step_buckets(runner_config: RunnerConfig) -> BucketSpec:
    """The buckets of a runner's steps; with speculation, mixed ones from
    SPECULATIVE_MIN_TOKENS tokens."""
    return BucketSpec(
        runner_config.max_num_batched_tokens,
        runner_config.max_num_seqs,
        **(
            {"min_mixed_tokens": SPECULATIVE_MIN_TOKENS}
            if runner_config.num_speculative_tokens
            else {}
        ),
    )


def step_layout(
    config: ModelConfig,
    runner_config: RunnerConfig,
    kv_groups: KVCacheGroups | None,
    encoder: EncoderRunner | None,
) -> StepLayout:
    """What the steps of a runner of `config` hold besides their bucket. `kv_groups`: the
    layers' KV groups, None: one group of all; `encoder`: the encoder of a model that takes
    images, else None."""
    block_size = runner_config.block_size
    # Block tables are padded so that the reference backend's page chunks (decode and mixed)
    # tile them exactly: a chunk that ran past the end would be clamped back onto other pages.
    chunk = math.lcm(pages_per_chunk(block_size, 1), pages_per_chunk(block_size, MIXED_TILE_Q))
    max_blocks = math.ceil(runner_config.max_model_len / block_size)
    return StepLayout(
        block_size,
        math.ceil(max_blocks / chunk) * chunk,
        config.vocab_size,
        has_adapters=bool(config.max_loras),
        num_speculative_tokens=runner_config.num_speculative_tokens,
        # Hybrid KV groups: each step carries every group's tables.
        num_kv_groups=kv_groups.num_groups if kv_groups else 1,
        image_embeds=(
            (encoder.embed_width, config.dtype, encoder.has_rope_positions) if encoder else None
        ),
        # Gemma 3: image tokens attend to their whole image (attention/image_ahead.py).
        has_image_groups=bool(config.option("bidirectional_images")),
    )


def step_attention(
    config: ModelConfig,
    layout: StepLayout,
    attention_backend: str,
    kv_groups: KVCacheGroups | None,
):
    """The attention of `config`'s steps laid out in `layout`: `attention_backend`'s, with the
    model's scale, softcap and latent KV rows, its image tokens attending to their whole image
    where the steps carry image groups, and each layer in its KV group's pages where they
    carry several groups' tables (attention/backends.py)."""
    attn = get_attention(
        attention_backend,
        sm_scale=config.sm_scale,
        logit_softcap=config.attn_logit_softcap,
        max_image_tokens=image_num_embeds(config) if layout.has_image_groups else 0,
        latent_dim=config.option("kv_lora_rank") if config.kv_planes == 1 else None,
    )
    return in_kv_groups(attn, kv_groups) if layout.num_kv_groups > 1 else attn
