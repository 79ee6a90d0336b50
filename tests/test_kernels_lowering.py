"""Both kernels lower for CUDA (Triton) at production shapes, through an abstract H100 on CPU."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import paged_decode_attention, ragged_paged_attention
from kernels_pallas.lowering import lower_for_cuda, num_triton_calls

SDS = jax.ShapeDtypeStruct
NUM_LAYERS = 32
NUM_PAGES = 8192

# (name, N, K, H, B): SmolLM2-135M, Llama-3-8B, and page sizes / head dims at the edges.
MODELS = [
    ("smollm2", 9, 3, 64, 16),
    ("llama-8b", 32, 8, 128, 16),
    ("llama-8b-page8", 32, 8, 128, 8),
    ("llama-8b-page128", 32, 8, 128, 128),
    ("gqa-8-to-1", 64, 8, 128, 16),
    ("head-dim-80", 32, 32, 80, 16),
    ("gemma2-9b", 16, 8, 256, 16),
]


def _kv(num_kv_heads: int, head_dim: int, page_size: int, dtype) -> SDS:
    return SDS((NUM_LAYERS, 2, num_kv_heads, NUM_PAGES, page_size, head_dim), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(("name", "num_heads", "num_kv_heads", "head_dim", "page_size"), MODELS)
@pytest.mark.parametrize("num_seqs", [8, 256])
def test_decode_lowers_for_cuda(
    name, num_heads, num_kv_heads, head_dim, page_size, num_seqs, dtype
):
    max_pages = 32768 // page_size
    lowered = lower_for_cuda(
        functools.partial(paged_decode_attention, sm_scale=head_dim**-0.5),
        SDS((num_seqs, num_heads, head_dim), dtype),
        _kv(num_kv_heads, head_dim, page_size, dtype),
        SDS((), jnp.int32),
        SDS((num_seqs, max_pages), jnp.int32),
        SDS((num_seqs,), jnp.int32),
    )
    assert num_triton_calls(lowered) == 1


@pytest.mark.parametrize(("name", "num_heads", "num_kv_heads", "head_dim", "page_size"), MODELS)
@pytest.mark.parametrize(("num_tokens", "num_seqs"), [(16, 16), (2048, 256)])
def test_ragged_lowers_for_cuda(
    name, num_heads, num_kv_heads, head_dim, page_size, num_tokens, num_seqs
):
    max_pages = 8192 // page_size
    lowered = lower_for_cuda(
        functools.partial(ragged_paged_attention, sm_scale=head_dim**-0.5),
        SDS((num_tokens, num_heads, head_dim), jnp.bfloat16),
        _kv(num_kv_heads, head_dim, page_size, jnp.bfloat16),
        SDS((), jnp.int32),
        SDS((num_seqs, max_pages), jnp.int32),
        SDS((num_seqs,), jnp.int32),
        SDS((num_seqs + 1,), jnp.int32),
    )
    assert num_triton_calls(lowered) == 1


@pytest.mark.parametrize("head_dim", [128, 256])
def test_windowed_and_soft_capped_kernels_lower_for_cuda(head_dim):
    """A traced window (the layer scan's) and tanh soft-capping go through the Triton lowering."""
    num_seqs, page_size, max_pages = 8, 16, 512
    options = {"sm_scale": head_dim**-0.5, "logit_softcap": 50.0}
    kv = _kv(8, head_dim, page_size, jnp.bfloat16)
    tables, lens = SDS((num_seqs, max_pages), jnp.int32), SDS((num_seqs,), jnp.int32)
    decode = lower_for_cuda(
        lambda *a: paged_decode_attention(*a[:-1], sliding_window=a[-1], **options),
        SDS((num_seqs, 16, head_dim), jnp.bfloat16),
        kv,
        SDS((), jnp.int32),
        tables,
        lens,
        SDS((), jnp.int32),
    )
    ragged = lower_for_cuda(
        lambda *a: ragged_paged_attention(*a[:-1], sliding_window=a[-1], **options),
        SDS((256, 16, head_dim), jnp.bfloat16),
        kv,
        SDS((), jnp.int32),
        tables,
        lens,
        SDS((num_seqs + 1,), jnp.int32),
        SDS((), jnp.int32),
    )
    assert num_triton_calls(decode) == num_triton_calls(ragged) == 1


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.int8])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_kernels_on_a_quantized_cache_lower_for_cuda(kv_dtype, head_dim):
    """1-byte pages with bfloat16 scales, converted inside the kernels (a padded head too)."""
    num_seqs, page_size, max_pages = 8, 16, 512
    sm_scale = head_dim**-0.5
    kv = _kv(8, head_dim, page_size, kv_dtype)
    scales = SDS(kv.shape[:5], jnp.bfloat16)
    tables, lens = SDS((num_seqs, max_pages), jnp.int32), SDS((num_seqs,), jnp.int32)
    decode = lower_for_cuda(
        lambda *a: paged_decode_attention(*a[:-1], sm_scale=sm_scale, kv_scales=a[-1]),
        SDS((num_seqs, 32, head_dim), jnp.bfloat16),
        kv,
        SDS((), jnp.int32),
        tables,
        lens,
        scales,
    )
    ragged = lower_for_cuda(
        lambda *a: ragged_paged_attention(*a[:-1], sm_scale=sm_scale, kv_scales=a[-1]),
        SDS((256, 32, head_dim), jnp.bfloat16),
        kv,
        SDS((), jnp.int32),
        tables,
        lens,
        SDS((num_seqs + 1,), jnp.int32),
        scales,
    )
    assert num_triton_calls(decode) == num_triton_calls(ragged) == 1


def test_lowering_check_catches_a_block_that_is_not_a_power_of_two():
    def copy_kernel(x_ref, o_ref):  # [24, 16]
        o_ref[...] = x_ref[...]

    def copy(x):
        return pl.pallas_call(
            copy_kernel,
            out_shape=SDS(x.shape, x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        )(x)

    with pytest.raises(ValueError, match="power of 2"):
        lower_for_cuda(copy, SDS((24, 16), jnp.float32))
