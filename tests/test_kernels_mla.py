"""mla_decode_attention in interpret mode against its pure-jnp reference, and that reference
against dense softmax attention written out here (CPU); both lower for CUDA at DeepSeek-V3's
shapes; compiled on a GPU when there is one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.kv_quant import QuantizedKVCache, dequantize, quantize, quantized_dtype
from jvllm.attention.metadata import AttentionMetadata, build_tiles
from jvllm.attention.pallas import pallas_attention
from kernels_pallas import (
    mla_decode_attention,
    mla_decode_attention_reference,
    ragged_paged_attention,
)
from kernels_pallas.lowering import lower_for_cuda, num_triton_calls
from kernels_pallas.testing import make_paged_kv

NUM_LAYERS = 2
LAYER = 1  # not 0: the kernel must index the layer inside the whole cache
LATENT_DIM = 32  # C; DeepSeek-V3's is 512
ROPE_DIM = 16  # R; DeepSeek-V3's is 64
PAGE_SIZE = 8
MAX_PAGES = 12  # max length 96: several of the kernel's 32-row (16 in float32) steps
NUM_PAGES = 96
# 1, a page boundary -1/0/+1, the maximum, a padding sequence, something in between.
SEQ_LENS = [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, MAX_PAGES * PAGE_SIZE, 0, 37]
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# DeepSeek-V3's latent (C), rope part (R) and vLLM's page size for its Triton MLA backend.
DEEPSEEK_V3_DIMS = {"latent_dim": 512, "rope_dim": 64, "page_size": 16}


def _case(
    seed: int,
    seq_lens: list[int],
    num_heads: int,
    dtype,
    *,
    latent_dim: int = LATENT_DIM,
    rope_dim: int = ROPE_DIM,
    page_size: int = PAGE_SIZE,
    max_pages: int = MAX_PAGES,
    num_pages: int = NUM_PAGES,
):
    """(q [S, N, C + R], the latent cache [L, 1, 1, P, B, C + R], layer, block_tables,
    seq_lens), in f32: NaN in every slot no sequence owns."""
    rng = np.random.default_rng(seed)
    kv_cache, block_tables = make_paged_kv(
        rng,
        seq_lens,
        num_layers=NUM_LAYERS,
        num_kv_heads=1,
        num_pages=num_pages,
        page_size=page_size,
        head_dim=latent_dim + rope_dim,
        max_pages_per_seq=max_pages,
    )
    q = rng.standard_normal((len(seq_lens), num_heads, latent_dim + rope_dim), dtype=np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(kv_cache[:, :1], dtype),  # one plane: the rows are keys and values
        jnp.int32(LAYER),
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens, jnp.int32),
    )


def _random_lengths(seed: int, num_seqs: int, max_len: int = MAX_PAGES * PAGE_SIZE) -> list[int]:
    return [*np.random.default_rng(seed).integers(1, max_len + 1, num_seqs).tolist(), 0]


@functools.cache
def _kernel(latent_dim: int, sm_scale: float, num_kv_splits: int | None, heads: int | None):
    return jax.jit(
        functools.partial(
            mla_decode_attention,
            latent_dim=latent_dim,
            sm_scale=sm_scale,
            num_kv_splits=num_kv_splits,
            heads_per_program=heads,
            interpret=True,
        )
    )


def _check(
    args,
    *,
    latent_dim: int = LATENT_DIM,
    num_kv_splits: int | None = None,
    heads_per_program: int | None = None,
    kv_scales: jax.Array | None = None,
) -> np.ndarray:
    q, seq_lens = args[0], args[4]
    sm_scale = q.shape[2] ** -0.5
    kernel = _kernel(latent_dim, sm_scale, num_kv_splits, heads_per_program)
    out = kernel(*args, kv_scales=kv_scales)
    ref = mla_decode_attention_reference(
        *args, latent_dim=latent_dim, sm_scale=sm_scale, kv_scales=kv_scales
    )
    assert out.dtype == q.dtype and out.shape == (*q.shape[:2], latent_dim)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "the kernel read a NaN slot past a length or the null page"
    tol = TOLERANCE[q.dtype.type]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[np.asarray(seq_lens) == 0], 0.0)
    return out


def _dense_mla(q, rows, block_tables, seq_lens, latent_dim: int, sm_scale: float) -> np.ndarray:
    """Softmax attention written out: each sequence's rows [n, C + R] are its keys, and their
    first C dims its values -> f32[S, N, C]."""
    q, rows = np.asarray(q, np.float64), np.asarray(rows, np.float64)  # [S, N, C+R], [P, B, C+R]
    out = np.zeros((*q.shape[:2], latent_dim))
    for s, seq_len in enumerate(np.asarray(seq_lens)):
        if seq_len == 0:
            continue
        keys = rows[np.asarray(block_tables)[s]].reshape(-1, rows.shape[-1])[:seq_len]  # [n, C+R]
        logits = q[s] @ keys.T * sm_scale  # [N, n]
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        out[s] = probs / probs.sum(axis=1, keepdims=True) @ keys[:, :latent_dim]
    return out


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8", "int8"])
def test_reference_is_dense_softmax_over_the_rows_with_their_latent_as_values(kv_cache_dtype):
    q, kv_cache, layer, block_tables, seq_lens = _case(0, SEQ_LENS, 5, jnp.float32)
    scales, rows = None, kv_cache[LAYER, 0, 0]  # [P, B, C+R]
    if kv_cache_dtype is not None:
        kv_cache, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
        rows = dequantize(kv_cache[LAYER, 0, 0], scales[LAYER, 0, 0])
    ref = mla_decode_attention_reference(
        q,
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        latent_dim=LATENT_DIM,
        sm_scale=0.2,
        kv_scales=scales,
    )
    want = _dense_mla(q, rows, block_tables, seq_lens, LATENT_DIM, 0.2)
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5, rtol=1e-5)


# Interpreted kernels cost seconds a case on 2 cores: the default run keeps one case of each
# kind, the slow job (pytest -m slow) the others.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("num_heads", "dtype"),
    [
        (2, jnp.float32),
        (16, jnp.bfloat16),
        (40, jnp.float32),
        pytest.param(2, jnp.bfloat16, marks=_SLOW),
        pytest.param(16, jnp.float32, marks=_SLOW),
        pytest.param(40, jnp.bfloat16, marks=_SLOW),
    ],
)
def test_mla_decode_matches_reference_on_ragged_lengths_and_shuffled_pages(num_heads, dtype):
    _check(_case(1, SEQ_LENS + _random_lengths(1, 3), num_heads, dtype))


@pytest.mark.parametrize(
    "page_size", [pytest.param(16, marks=_SLOW), 32, pytest.param(64, marks=_SLOW)]
)
def test_mla_decode_reads_pages_larger_than_a_step_a_slice_at_a_time(page_size):
    """bfloat16 steps are 32 rows: 2 pages of 16, one of 32, half of one of 64."""
    seq_lens = [1, page_size - 1, page_size + 1, 4 * page_size, 0, 3 * page_size - 5]
    args = _case(2, seq_lens, 16, jnp.bfloat16, page_size=page_size, max_pages=4, num_pages=24)
    _check(args)


@pytest.mark.parametrize(
    ("num_kv_splits", "heads_per_program"),
    [pytest.param(1, 16, marks=_SLOW), (3, 32), pytest.param(4, 64, marks=_SLOW)],
)
def test_mla_decode_is_independent_of_splits_and_heads_per_program(
    num_kv_splits, heads_per_program
):
    args = _case(3, SEQ_LENS, 64, jnp.float32)
    _check(args, num_kv_splits=num_kv_splits, heads_per_program=heads_per_program)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"), [("fp8", jnp.bfloat16), ("int8", jnp.float32)]
)
def test_mla_decode_on_a_quantized_cache_matches_reference(kv_cache_dtype, dtype):
    """1-byte rows and their scales [L, 1, 1, P, B] (NaN where no sequence owns a slot),
    dequantized inside the kernel: a row's one scale serves its logit and its value."""
    q, kv_cache, *rest = _case(4, _random_lengths(4, 6), 16, jnp.float32)
    values, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
    _check((q.astype(dtype), values, *rest), kv_scales=scales)


def test_mla_decode_at_deepseek_v3_dims():
    """C = 512, R = 64 (576 rows, not a power of two), 16 heads (128 under 8-way TP)."""
    seq_lens = [1, 15, 16, 17, 70, 0]
    args = _case(5, seq_lens, 16, jnp.bfloat16, **DEEPSEEK_V3_DIMS, max_pages=5, num_pages=16)
    _check(args, latent_dim=512)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "kv_cache": jnp.tile(a["kv_cache"], (1, 2, 1, 1, 1, 1))}, "latent cache"),
        (lambda a: {**a, "kv_cache": jnp.tile(a["kv_cache"], (1, 1, 2, 1, 1, 1))}, "latent cache"),
        (lambda a: {**a, "latent_dim": 24}, "C = 24, R = "),
        (lambda a: {**a, "q": a["q"][..., :40], "kv_cache": a["kv_cache"][..., :40]}, "R = 8"),
        (lambda a: {**a, "heads_per_program": 8}, "heads_per_program"),
        (lambda a: {**a, "num_kv_splits": 0}, "num_kv_splits"),
        (lambda a: {**a, "q": a["q"][..., :32]}, "head dim"),
        (lambda a: {**a, "block_tables": a["block_tables"][:-1]}, "seq_lens"),
    ],
)
def test_mla_decode_rejects_bad_inputs_with_a_clear_error(change, message):
    names = ("q", "kv_cache", "layer", "block_tables", "seq_lens")
    args = {**dict(zip(names, _case(6, [3, 9], 4, jnp.float32), strict=True)), "latent_dim": 32}
    with pytest.raises(ValueError, match=message):
        mla_decode_attention(**change(args), sm_scale=0.1, interpret=True)


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_the_pallas_backend_decodes_on_the_latent_cache_with_the_mla_kernel(kv_cache_dtype):
    """A decode step's attn returns the MLA kernel's [S, N, C] over the cache it wrote, padded
    with zeros to the rows' C + R, as the other kernels' outputs are [T, N, H]."""
    seq_lens = [5, 17, 1, 0]  # after this step's token; 0: a padding sequence
    q, kv_cache, layer, block_tables, lens = _case(8, seq_lens, 16, jnp.float32)
    scales = None
    if kv_cache_dtype is not None:
        kv_cache, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
    last = np.maximum(np.asarray(seq_lens) - 1, 0)
    pages = np.asarray(block_tables)[np.arange(len(seq_lens)), last // PAGE_SIZE]
    query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(pages * PAGE_SIZE + last % PAGE_SIZE, jnp.int32),
        block_tables=block_tables,
        seq_lens=lens,
        query_start_loc=jnp.asarray(query_start_loc),
        logits_indices=jnp.arange(len(seq_lens), dtype=jnp.int32),
        tiles=build_tiles(query_start_loc, np.asarray(seq_lens), len(seq_lens), ((1, 4),)),
    )
    assert md.is_decode
    k = jnp.asarray(np.random.default_rng(8).standard_normal((4, 1, 48)), jnp.float32)
    cache = kv_cache if scales is None else QuantizedKVCache(kv_cache, scales)
    attn = pallas_attention(48**-0.5, interpret=True, latent_dim=LATENT_DIM)
    out, cache = attn(layer, q, k, k, cache, md)
    values, scales = (cache, None) if scales is None else (cache.values, cache.scales)
    ref = mla_decode_attention_reference(
        q,
        values,
        layer,
        block_tables,
        lens,
        latent_dim=LATENT_DIM,
        sm_scale=48**-0.5,
        kv_scales=scales,
    )
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out[..., :LATENT_DIM]), np.asarray(ref), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out[..., LATENT_DIM:]), 0.0)


SDS = jax.ShapeDtypeStruct


def _deepseek_v3_inputs(num_seqs: int, num_heads: int, page_size: int, dtype, kv_dtype):
    """q, the latent cache (61 layers, 576 dims), layer, block tables for 32k, seq_lens."""
    return (
        SDS((num_seqs, num_heads, 576), dtype),
        SDS((61, 1, 1, 4096, page_size, 576), kv_dtype),
        SDS((), jnp.int32),
        SDS((num_seqs, 32768 // page_size), jnp.int32),
        SDS((num_seqs,), jnp.int32),
    )


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "page_size", "heads_per_program"),
    [
        (jnp.bfloat16, jnp.bfloat16, 16, None),
        (jnp.float32, jnp.float32, 8, None),
        (jnp.bfloat16, jnp.float8_e4m3fn, 64, 64),
        (jnp.bfloat16, jnp.int8, 16, 128),
    ],
)
def test_mla_decode_lowers_for_cuda_at_deepseek_v3_shapes(
    dtype, kv_dtype, page_size, heads_per_program
):
    args = _deepseek_v3_inputs(8, 128, page_size, dtype, kv_dtype)
    options = {"latent_dim": 512, "sm_scale": 0.1, "heads_per_program": heads_per_program}
    if kv_dtype == dtype:
        fn = functools.partial(mla_decode_attention, **options)
    else:
        args = (*args, SDS(args[1].shape[:5], jnp.bfloat16))
        fn = lambda *a: mla_decode_attention(*a[:-1], kv_scales=a[-1], **options)
    assert num_triton_calls(lower_for_cuda(fn, *args)) == 1


def test_the_ragged_kernel_lowers_for_cuda_on_the_latent_cache():
    """Prefill over the latent cache goes through the generic ragged kernel (V is K)."""
    _, kv_cache, layer, block_tables, seq_lens = _deepseek_v3_inputs(
        16, 16, 16, jnp.bfloat16, jnp.bfloat16
    )
    lowered = lower_for_cuda(
        functools.partial(ragged_paged_attention, sm_scale=0.1),
        SDS((512, 16, 576), jnp.bfloat16),
        kv_cache,
        layer,
        block_tables,
        seq_lens,
        SDS((17,), jnp.int32),
    )
    assert num_triton_calls(lowered) == 1


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled Triton kernel)"
)
@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "num_heads"),
    [(None, jnp.float32, 16), (None, jnp.bfloat16, 128), ("fp8", jnp.bfloat16, 16)],
)
def test_mla_decode_compiled_on_gpu_matches_reference(kv_cache_dtype, dtype, num_heads):
    seq_lens = [1, 15, 16, 17, 300, 0, 1000, 64]
    q, kv_cache, *rest = _case(
        7, seq_lens, num_heads, jnp.float32, **DEEPSEEK_V3_DIMS, max_pages=64, num_pages=128
    )
    scales = None
    if kv_cache_dtype is None:
        kv_cache = kv_cache.astype(dtype)
    else:
        kv_cache, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
    args = (q.astype(dtype), kv_cache, *rest)
    options = {"latent_dim": 512, "sm_scale": 576**-0.5, "kv_scales": scales}
    out = jax.jit(functools.partial(mla_decode_attention, **options))(*args)
    ref = mla_decode_attention_reference(*args, **options)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol
    )
