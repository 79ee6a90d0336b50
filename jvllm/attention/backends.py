"""Choosing the attention implementation: "reference" (pure JAX) or "pallas" (kernels_pallas/)."""

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.attention import cpu_decode
from jvllm.attention.reference import reference_attention
from jvllm.core.kv_groups import KVCacheGroups

ATTENTION_BACKENDS = ("reference", "pallas")


def default_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def prepare_backend(name: str, kv_cache_dtype: str, block_size: int, dtype: str) -> None:
    """Check that backend `name` takes the engine's settings, before the model loads, and start
    what it builds on its first use, so that it overlaps with loading: the reference backend's
    CPU decode kernel, which reads the float32 and bfloat16 caches of models of `dtype`."""
    if name == "pallas":
        from kernels_pallas import is_supported_page_size  # imports Pallas: only for its users

        if not is_supported_page_size(block_size):
            raise ValueError(
                f"block_size={block_size} does not suit attention_backend='pallas' (the default "
                "on a GPU), whose kernels take a power of two >= 8; use e.g. 16, or the "
                "'reference' backend"
            )
    if name == "reference" and kv_cache_dtype == "auto":
        cpu_decode.build_early(dtype)


def get_attention(
    name: str,
    sm_scale: float,
    logit_softcap: float | None = None,
    max_image_tokens: int = 0,
    latent_dim: int | None = None,
):
    """The `attn` callable of the model contract for backend `name`:
    attn(layer, q, k, v, kv_cache, md, sliding_window=None, sinks=None) -> (out, kv_cache).

    logit_softcap: None, or Gemma 2's static cap c (scores c * tanh(score / c) after scaling).
    sliding_window (per call): None for a model without windowed layers, else i32[] W, possibly
    traced (a scanned per-layer input; a global layer of a mixed model passes a W that never
    cuts, e.g. 2**30): a query at p sees p - W < j <= p.
    sinks (per call): None, or f32[N] per-head logits (possibly traced) that join every query's
    softmax with no value and no scaling (gpt-oss's attention sinks).
    max_image_tokens > 0: the model's image tokens, up to that many an image, attend to their
    whole image (Gemma 3; `md.image_groups`), which only the reference backend does.
    latent_dim: MLA's C where the cache holds its latent rows (layers/mla.py): the Pallas
    backend's decode then runs its MLA kernel; the reference backend reads any 1-plane cache.
    """
    if logit_softcap is not None and not 0 < logit_softcap < float("inf"):
        raise ValueError(f"logit_softcap must be None or a positive float, got {logit_softcap!r}")
    if name == "reference":
        return reference_attention(sm_scale, logit_softcap, max_image_tokens)
    if name == "pallas" and max_image_tokens:
        raise ValueError(
            "this model's image tokens attend to their whole image (Gemma 3), which the "
            "'pallas' backend's kernels do not; use attention_backend='reference'"
        )
    if name == "pallas":
        from jvllm.attention.pallas import pallas_attention

        return pallas_attention(
            sm_scale,
            interpret=jax.default_backend() != "gpu",
            logit_softcap=logit_softcap,
            latent_dim=latent_dim,
        )
    raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")


def in_kv_groups(attn, groups: KVCacheGroups):
    """`attn` for a model whose layers are in hybrid KV groups (core/kv_groups.py): layer l
    writes and reads row `layer_slot[l]` of the pages in its group's tables."""
    slots = np.asarray(groups.layer_slot, np.int32)  # [L]
    group_of = np.asarray(groups.layer_group, np.int32)  # [L]

    def attn_in_group(layer, q, k, v, kv_cache, md, **options):
        slot, group = jnp.asarray(slots)[layer], jnp.asarray(group_of)[layer]
        return attn(slot, q, k, v, kv_cache, md.for_group(group), **options)

    return attn_in_group
