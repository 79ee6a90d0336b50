"""ragged_paged_attention in interpret mode against its pure-jnp reference (CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.kv_quant import quantize, quantized_dtype
from kernels_pallas import (
    paged_decode_attention,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas.testing import make_paged_kv

NUM_LAYERS = 3
LAYER = 1
NUM_KV_HEADS = 2
PAGE_SIZE = 8
MAX_PAGES = 8  # max length 64
NUM_PAGES = 48
NUM_TOKENS = 64  # T, padded past the real queries
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (seq_len, q_len) per sequence; q_len == seq_len is a whole prompt, q_len == 1 a decode.
MIXED = [
    (1, 1),  # first decode step
    (PAGE_SIZE + 1, 1),  # decode just past a page boundary
    (PAGE_SIZE - 1, PAGE_SIZE - 1),  # short prompt
    (40, 17),  # chunked prefill continuing at position 23, spans query tiles
    (0, 0),  # padding sequence
    (MAX_PAGES * PAGE_SIZE, 1),  # decode at the maximum length
    (2 * PAGE_SIZE, 2 * PAGE_SIZE),  # prompt ending on a page boundary
]
PREFILL_ONLY = [(33, 33), (1, 1), (PAGE_SIZE, PAGE_SIZE), (17, 17)]
DECODE_ONLY = [(1, 1), (PAGE_SIZE - 1, 1), (PAGE_SIZE, 1), (PAGE_SIZE + 1, 1), (64, 1), (0, 0)]


def _case(
    seed: int,
    seqs: list[tuple[int, int]],
    group: int,
    head_dim: int,
    dtype,
    num_tokens: int = NUM_TOKENS,
    page_size: int = PAGE_SIZE,
    max_pages: int = MAX_PAGES,
    num_pages: int = NUM_PAGES,
):
    rng = np.random.default_rng(seed)
    seq_lens = [seq_len for seq_len, _ in seqs]
    kv_cache, block_tables = make_paged_kv(
        rng,
        seq_lens,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        num_pages=num_pages,
        page_size=page_size,
        head_dim=head_dim,
        max_pages_per_seq=max_pages,
    )
    query_start_loc = np.concatenate([[0], np.cumsum([q_len for _, q_len in seqs])])
    assert query_start_loc[-1] <= num_tokens
    q = rng.standard_normal((num_tokens, NUM_KV_HEADS * group, head_dim), dtype=np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(kv_cache, dtype),
        jnp.int32(LAYER),
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens, jnp.int32),
        jnp.asarray(query_start_loc, jnp.int32),
    )


@functools.cache
def _kernel(sm_scale: float, logit_softcap: float | None = None):
    """Jitted, so that a sliding_window passed to it is traced, as in the model's layer scan."""
    return jax.jit(
        functools.partial(
            ragged_paged_attention, sm_scale=sm_scale, logit_softcap=logit_softcap, interpret=True
        )
    )


def _check(
    args,
    sm_scale: float = 0.125,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: jax.Array | None = None,
) -> np.ndarray:
    window = None if sliding_window is None else jnp.int32(sliding_window)
    out = _kernel(sm_scale, logit_softcap)(*args, sliding_window=window, kv_scales=kv_scales)
    ref = ragged_paged_attention_reference(
        *args,
        sm_scale=sm_scale,
        sliding_window=window,
        logit_softcap=logit_softcap,
        kv_scales=kv_scales,
    )
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "the kernel read a NaN slot past a length or the null page"
    num_real = int(args[5][-1])
    tol = TOLERANCE[args[0].dtype.type]
    np.testing.assert_allclose(out[:num_real], ref[:num_real], atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[num_real:], 0.0)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_ragged_matches_reference_on_a_mixed_batch(group, dtype):
    _check(_case(0, MIXED, group, 64, dtype))


@pytest.mark.parametrize("group", [1, 3])
def test_ragged_matches_reference_on_prefill_only(group):
    _check(_case(1, PREFILL_ONLY, group, 64, jnp.float32))


def test_ragged_pads_a_head_dim_that_is_not_a_power_of_two():
    _check(_case(2, MIXED, 3, 48, jnp.float32), sm_scale=48**-0.5)


def test_ragged_with_large_pages_and_head_dim_128():
    seqs = [(100, 30), (16, 16), (1, 1), (0, 0), (128, 1), (17, 2)]
    _check(_case(3, seqs, 4, 128, jnp.bfloat16, page_size=16), sm_scale=128**-0.5)


@pytest.mark.parametrize("group", [3, 8])
def test_ragged_decode_only_agrees_with_the_decode_kernel(group):
    args = _case(4, DECODE_ONLY, group, 64, jnp.float32, num_tokens=len(DECODE_ONLY))
    out = _check(args)
    q, kv_cache, layer, block_tables, seq_lens, _ = args
    decode = paged_decode_attention(
        q, kv_cache, layer, block_tables, seq_lens, sm_scale=0.125, interpret=True
    )
    np.testing.assert_allclose(out, np.asarray(decode), atol=2e-5, rtol=2e-5)


def _random_batch(rng: np.random.Generator, num_seqs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) of prefills, chunks and decodes that fit the pool and NUM_TOKENS."""
    seq_lens = rng.integers(1, MAX_PAGES * PAGE_SIZE + 1, num_seqs)
    return [(int(n), int(rng.integers(1, min(n, NUM_TOKENS // num_seqs) + 1))) for n in seq_lens]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "window"), [("fp8", jnp.bfloat16, None), ("int8", jnp.float32, 13)]
)
def test_ragged_on_a_quantized_cache_matches_reference_on_a_random_batch(
    kv_cache_dtype, dtype, window
):
    """1-byte pages and their scales (NaN where no sequence owns a slot) are dequantized inside
    the kernel as the reference does over whole pages."""
    seqs = _random_batch(np.random.default_rng(40), 5)
    q, kv_cache, *rest = _case(40, seqs, 3, 64, jnp.float32)
    values, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
    _check((q.astype(dtype), values, *rest), kv_scales=scales, sliding_window=window)


def _with_v_copied_from_k(kv_cache: jax.Array) -> jax.Array:
    """A 1-plane cache [L, 1, ...] as the 2-plane cache whose V plane is a copy of K."""
    return jnp.concatenate([kv_cache, kv_cache], axis=1)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype"),
    [
        (None, jnp.bfloat16),
        pytest.param(None, jnp.float32, marks=pytest.mark.slow),
        ("int8", jnp.float32),
    ],
)
def test_ragged_on_a_one_plane_cache_reads_v_as_k(kv_cache_dtype, dtype):
    """MLA's latent cache [L, 1, K, P, B, H] (and a quantized one's scales [L, 1, K, P, B]):
    the one plane is both the keys and the values; the reference there is the 2-plane reference
    with V a copy of K."""
    seqs = [*MIXED[:4], *_random_batch(np.random.default_rng(41), 3)]
    q, kv_cache, *rest = _case(41, seqs, 3, 48, jnp.float32, num_tokens=96, num_pages=64)
    values, scales = kv_cache[:, :1].astype(dtype), None
    if kv_cache_dtype is not None:
        values, scales = quantize(kv_cache[:, :1], quantized_dtype(kv_cache_dtype))
    q = q.astype(dtype)
    _check((q, values, *rest), 48**-0.5, kv_scales=scales)
    ref = ragged_paged_attention_reference(q, values, *rest, sm_scale=48**-0.5, kv_scales=scales)
    two_planes = ragged_paged_attention_reference(
        q,
        _with_v_copied_from_k(values),
        *rest,
        sm_scale=48**-0.5,
        kv_scales=None if scales is None else _with_v_copied_from_k(scales),
    )
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(two_planes))


# 1 (only itself), inside a page, a page, across pages and query tiles, a global layer's.
WINDOWS = [1, 5, PAGE_SIZE, 13, 30, 2**30]


@pytest.mark.parametrize("sliding_window", WINDOWS)
def test_ragged_with_a_sliding_window_matches_reference(sliding_window):
    _check(_case(7, MIXED, 3, 64, jnp.float32), sliding_window=sliding_window)


def test_ragged_window_starts_mid_context_in_long_chunked_prefills():
    """Prompts resuming after hundreds of positions in pages: tiles start at the window's page."""
    seqs = [(300, 40), (384, 1), (129, 100), (5, 5), (200, 3)]
    args = _case(8, seqs, 2, 64, jnp.float32, num_tokens=160, max_pages=48, num_pages=160)
    _check(args, sliding_window=50)


def test_ragged_window_of_one_returns_each_querys_own_value():
    seqs = [(9, 9), (40, 17), (1, 1)]
    q, kv_cache, layer, block_tables, seq_lens, qsl = _case(9, seqs, 2, 64, jnp.float32)
    out = _check((q, kv_cache, layer, block_tables, seq_lens, qsl), sliding_window=1)
    seq = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
    pos = np.concatenate([np.arange(kv - n, kv) for kv, n in seqs])
    pages = np.asarray(block_tables)[seq, pos // PAGE_SIZE]
    own_v = np.asarray(kv_cache)[LAYER, 1][:, pages, pos % PAGE_SIZE]  # [K, t, H]
    want = np.repeat(own_v.transpose(1, 0, 2), 2, axis=1)
    np.testing.assert_allclose(out[: len(seq)], want, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_with_logit_softcap_matches_reference(dtype):
    # sm_scale 1: logits of tens, well into the cap's saturation
    args = _case(10, MIXED, 3, 64, dtype)
    capped = _check(args, 1.0, logit_softcap=5.0)
    assert not np.allclose(capped, _check(args, 1.0), atol=1e-2)


def test_ragged_with_window_and_softcap_in_bfloat16():
    _check(_case(11, MIXED, 4, 64, jnp.bfloat16), sliding_window=13, logit_softcap=5.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 2])
def test_ragged_with_head_dim_256(group, dtype):
    _check(_case(12, MIXED, group, 256, dtype), 256**-0.5, sliding_window=13)


def test_ragged_takes_the_window_as_a_scanned_input():
    """The model scans over layers with each layer's window as data (a global one: 2**30)."""
    args = _case(13, MIXED, 3, 64, jnp.float32)
    windows = jnp.array([5, 2**30, 13], jnp.int32)
    fn = functools.partial(ragged_paged_attention, sm_scale=0.125, interpret=True)

    def scan():
        return jax.lax.scan(lambda c, w: (c, fn(*args, sliding_window=w)), 0, windows)[1]

    num_real = int(args[5][-1])
    for window, out in zip(windows, jax.jit(scan)()):
        ref = ragged_paged_attention_reference(*args, sm_scale=0.125, sliding_window=window)
        np.testing.assert_allclose(
            np.asarray(out)[:num_real], np.asarray(ref)[:num_real], atol=2e-5, rtol=2e-5
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sliding_window": jnp.float32(4)}, "sliding_window"),
        ({"sliding_window": jnp.array([4, 4], jnp.int32)}, "sliding_window"),
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"logit_softcap": -1.0}, "logit_softcap"),
        ({"logit_softcap": jnp.float32(5)}, "logit_softcap"),
    ],
)
def test_ragged_rejects_bad_window_or_softcap_with_a_clear_error(options, message):
    args = _case(14, [(3, 3)], 1, 64, jnp.float32)
    for fn in (ragged_paged_attention, ragged_paged_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(*args, sm_scale=0.1, **options)


@pytest.mark.parametrize(
    ("query_start_loc", "message"),
    [
        (jnp.zeros((3,), jnp.int32), "query_start_loc"),
        (jnp.zeros((2,), jnp.float32), "query_start_loc"),
    ],
)
def test_ragged_rejects_a_bad_query_start_loc(query_start_loc, message):
    q, kv_cache, layer, block_tables, seq_lens, _ = _case(5, [(3, 3)], 1, 64, jnp.float32)
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(
            q, kv_cache, layer, block_tables, seq_lens, query_start_loc, sm_scale=0.1
        )


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled Triton kernel)"
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_planes", [2, 1], ids=["two_planes", "one_plane"])
def test_ragged_compiled_on_gpu_matches_reference(num_planes, dtype):
    q, kv_cache, *rest = _case(6, MIXED, 4, 128, dtype)
    args = (q, kv_cache[:, :num_planes], *rest)
    out = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.1))(*args)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.1)
    num_real = int(args[5][-1])
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(out, np.float32)[:num_real],
        np.asarray(ref, np.float32)[:num_real],
        atol=tol,
        rtol=tol,
    )
