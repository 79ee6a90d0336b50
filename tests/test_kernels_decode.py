"""paged_decode_attention in interpret mode against its pure-jnp reference (CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.kv_quant import quantize, quantized_dtype
from kernels_pallas import paged_decode_attention, paged_decode_attention_reference
from kernels_pallas.testing import make_paged_kv

NUM_LAYERS = 3
LAYER = 2  # not 0: the kernel must index the layer inside the whole cache
NUM_KV_HEADS = 2
PAGE_SIZE = 8
MAX_PAGES = 8  # max length 64
NUM_PAGES = 48
# 1, a page boundary -1/0/+1, two pages -1, the maximum, a padding sequence, something in between.
SEQ_LENS = [
    1,
    PAGE_SIZE - 1,
    PAGE_SIZE,
    PAGE_SIZE + 1,
    2 * PAGE_SIZE - 1,
    MAX_PAGES * PAGE_SIZE,
    0,
    37,
]
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _case(
    seed: int,
    seq_lens: list[int],
    group: int,
    head_dim: int,
    dtype,
    page_size: int = PAGE_SIZE,
    max_pages: int = MAX_PAGES,
    num_pages: int = NUM_PAGES,
):
    rng = np.random.default_rng(seed)
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
    q = rng.standard_normal((len(seq_lens), NUM_KV_HEADS * group, head_dim), dtype=np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(kv_cache, dtype),
        jnp.int32(LAYER),
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens, jnp.int32),
    )


@functools.cache
def _kernel(sm_scale: float, num_kv_splits: int | None, logit_softcap: float | None = None):
    """Jitted, so that a sliding_window passed to it is traced, as in the model's layer scan."""
    return jax.jit(
        functools.partial(
            paged_decode_attention,
            sm_scale=sm_scale,
            num_kv_splits=num_kv_splits,
            logit_softcap=logit_softcap,
            interpret=True,
        )
    )


def _check(
    args,
    *,
    num_kv_splits: int | None = None,
    sm_scale: float = 0.125,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    kv_scales: jax.Array | None = None,
):
    window = None if sliding_window is None else jnp.int32(sliding_window)
    kernel = _kernel(sm_scale, num_kv_splits, logit_softcap)
    out = kernel(*args, sliding_window=window, kv_scales=kv_scales)
    ref = paged_decode_attention_reference(
        *args,
        sm_scale=sm_scale,
        sliding_window=window,
        logit_softcap=logit_softcap,
        kv_scales=kv_scales,
    )
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "the kernel read a NaN slot past a length or the null page"
    tol = TOLERANCE[args[0].dtype.type]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    padding = np.asarray(args[4]) == 0
    np.testing.assert_array_equal(out[padding], 0.0)
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_matches_reference_on_ragged_lengths_and_shuffled_pages(group, dtype):
    _check(_case(0, SEQ_LENS, group, 64, dtype))


@pytest.mark.parametrize("num_kv_splits", [1, 3, 4])
def test_decode_is_independent_of_the_number_of_kv_splits(num_kv_splits):
    _check(_case(1, SEQ_LENS, 3, 64, jnp.float32), num_kv_splits=num_kv_splits)


def test_decode_with_large_pages_and_head_dim_128():
    seq_lens = [1, 15, 16, 17, 33, 128, 0, 100]
    _check(_case(2, seq_lens, 4, 128, jnp.bfloat16, page_size=16), sm_scale=128**-0.5)


def test_decode_pads_a_head_dim_that_is_not_a_power_of_two():
    _check(_case(3, SEQ_LENS, 3, 48, jnp.float32), sm_scale=48**-0.5)


def test_decode_reads_the_requested_layer():
    args = _case(4, SEQ_LENS, 3, 64, jnp.float32)
    other_layer = _kernel(0.125, None)(args[0], args[1], jnp.int32(0), *args[3:])
    out = _kernel(0.125, None)(*args)
    assert not np.allclose(np.asarray(out), np.asarray(other_layer))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "head_dim", "window"),
    [("fp8", jnp.bfloat16, 64, None), ("int8", jnp.float32, 48, 13)],
)
def test_decode_on_a_quantized_cache_matches_reference(kv_cache_dtype, dtype, head_dim, window):
    """1-byte pages and their scales (NaN where no sequence owns a slot) are dequantized inside
    the kernel as the reference does over whole pages; a padded head dim and a window too."""
    seq_lens = [*np.random.default_rng(20).integers(1, MAX_PAGES * PAGE_SIZE + 1, 5).tolist(), 0]
    q, kv_cache, *rest = _case(20, seq_lens, 3, head_dim, jnp.float32)
    values, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
    args = (q.astype(dtype), values, *rest)
    _check(args, sm_scale=head_dim**-0.5, sliding_window=window, kv_scales=scales)


def _with_v_copied_from_k(kv_cache: jax.Array) -> jax.Array:
    """A 1-plane cache [L, 1, ...] as the 2-plane cache whose V plane is a copy of K."""
    return jnp.concatenate([kv_cache, kv_cache], axis=1)


@pytest.mark.parametrize(
    ("group", "dtype"), [(8, jnp.bfloat16), pytest.param(1, jnp.float32, marks=pytest.mark.slow)]
)
def test_decode_on_a_one_plane_cache_reads_v_as_k(group, dtype):
    """MLA's latent cache [L, 1, K, P, B, H]: the one plane is both the keys and the values;
    the reference there is the 2-plane reference with V a copy of K."""
    seq_lens = [*SEQ_LENS, *np.random.default_rng(30).integers(1, 65, 4).tolist()]
    q, kv_cache, *rest = _case(30, seq_lens, group, 48, dtype, num_pages=80)
    one_plane = kv_cache[:, :1]
    _check((q, one_plane, *rest), sm_scale=48**-0.5)
    ref = paged_decode_attention_reference(q, one_plane, *rest, sm_scale=48**-0.5)
    two_planes = paged_decode_attention_reference(
        q, _with_v_copied_from_k(one_plane), *rest, sm_scale=48**-0.5
    )
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(two_planes))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", pytest.param("int8", marks=pytest.mark.slow)])
def test_decode_on_a_quantized_one_plane_cache_matches_reference(kv_cache_dtype):
    """Values [L, 1, K, P, B, H] and scales [L, 1, K, P, B]: V's scales are K's."""
    seq_lens = [*np.random.default_rng(31).integers(1, MAX_PAGES * PAGE_SIZE + 1, 5).tolist(), 0]
    q, kv_cache, *rest = _case(31, seq_lens, 3, 64, jnp.float32)
    values, scales = quantize(kv_cache[:, :1], quantized_dtype(kv_cache_dtype))
    _check((q.astype(jnp.bfloat16), values, *rest), kv_scales=scales)
    ref = paged_decode_attention_reference(q, values, *rest, sm_scale=0.125, kv_scales=scales)
    two_planes = paged_decode_attention_reference(
        q,
        _with_v_copied_from_k(values),
        *rest,
        sm_scale=0.125,
        kv_scales=_with_v_copied_from_k(scales),
    )
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(two_planes))


# 1 (only itself), inside a page, a page, across pages, the longest length, a global layer's.
WINDOWS = [1, 5, PAGE_SIZE, 13, MAX_PAGES * PAGE_SIZE, 2**30]


@pytest.mark.parametrize("sliding_window", WINDOWS)
def test_decode_with_a_sliding_window_matches_reference(sliding_window):
    _check(_case(8, SEQ_LENS, 3, 64, jnp.float32), sliding_window=sliding_window)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_window_splits_share_only_the_pages_the_window_reaches(num_kv_splits):
    _check(_case(9, SEQ_LENS, 3, 64, jnp.float32), num_kv_splits=num_kv_splits, sliding_window=13)


@pytest.mark.parametrize("num_kv_splits", [1, None])
def test_decode_window_starts_mid_context_in_long_sequences(num_kv_splits):
    """Contexts of several 128-token blocks: a split walks blocks from the window's first page."""
    seq_lens = [300, 384, 129, 5, 200]
    args = _case(17, seq_lens, 2, 64, jnp.float32, max_pages=48, num_pages=160)
    _check(args, num_kv_splits=num_kv_splits, sliding_window=100)


def test_decode_window_of_the_whole_context_equals_no_window():
    args = _case(10, SEQ_LENS, 3, 64, jnp.float32)
    windowed = _check(args, sliding_window=2**30)
    np.testing.assert_allclose(windowed, _check(args), atol=1e-6, rtol=1e-6)


def test_decode_window_of_one_returns_the_querys_own_value():
    q, kv_cache, layer, block_tables, seq_lens = _case(11, [1, 9, 37], 2, 64, jnp.float32)
    out = _check((q, kv_cache, layer, block_tables, seq_lens), sliding_window=1)
    last = np.asarray(seq_lens) - 1
    pages = np.asarray(block_tables)[np.arange(3), last // PAGE_SIZE]
    own_v = np.asarray(kv_cache)[LAYER, 1][:, pages, last % PAGE_SIZE]  # [K, S, H]
    np.testing.assert_allclose(out, np.repeat(own_v.transpose(1, 0, 2), 2, axis=1), atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_with_logit_softcap_matches_reference(dtype):
    # sm_scale 1: logits of tens, well into the cap's saturation
    args = _case(12, SEQ_LENS, 3, 64, dtype)
    capped = _check(args, sm_scale=1.0, logit_softcap=5.0)
    assert not np.allclose(capped, _check(args, sm_scale=1.0), atol=1e-2)


def test_decode_with_window_and_softcap_in_bfloat16():
    _check(_case(13, SEQ_LENS, 4, 64, jnp.bfloat16), sliding_window=13, logit_softcap=5.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 2])
def test_decode_with_head_dim_256(group, dtype):
    _check(_case(14, SEQ_LENS, group, 256, dtype), sm_scale=256**-0.5, sliding_window=13)


def test_decode_takes_the_window_as_a_scanned_input():
    """The model scans over layers with each layer's window as data (a global one: 2**30)."""
    args = _case(15, SEQ_LENS, 3, 64, jnp.float32)
    windows = jnp.array([5, 2**30, 13], jnp.int32)
    fn = functools.partial(paged_decode_attention, sm_scale=0.125, interpret=True)

    def scan():
        return jax.lax.scan(lambda c, w: (c, fn(*args, sliding_window=w)), 0, windows)[1]

    for window, out in zip(windows, jax.jit(scan)()):
        ref = paged_decode_attention_reference(*args, sm_scale=0.125, sliding_window=window)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sliding_window": jnp.float32(4)}, "sliding_window"),
        ({"sliding_window": jnp.array([4, 4], jnp.int32)}, "sliding_window"),
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"sliding_window": jnp.int32(-3)}, "sliding_window must be >= 1"),
        ({"logit_softcap": 0.0}, "logit_softcap"),
        ({"logit_softcap": float("inf")}, "logit_softcap"),
        ({"logit_softcap": jnp.float32(5)}, "logit_softcap"),
    ],
)
def test_decode_rejects_bad_window_or_softcap_with_a_clear_error(options, message):
    args = _case(16, [3, 9], 2, 64, jnp.float32)
    for fn in (paged_decode_attention, paged_decode_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(*args, sm_scale=0.1, **options)


def test_a_window_or_layer_known_at_trace_time_is_checked_inside_jit():
    q, kv_cache, _, block_tables, seq_lens = _case(16, [3, 9], 2, 64, jnp.float32)
    for layer, window, message in ((0, 0, "sliding_window"), (NUM_LAYERS, None, "out of range")):

        def call(q, layer=layer, window=window):
            return paged_decode_attention(
                q, kv_cache, layer, block_tables, seq_lens, sm_scale=0.1, sliding_window=window
            )

        with pytest.raises(ValueError, match=message):
            jax.jit(call)(q)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].astype(jnp.float16)}, "share one dtype"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "not a multiple of K"),
        (lambda a: {**a, "q": a["q"][..., :32]}, "head dim"),
        (lambda a: {**a, "kv_cache": a["kv_cache"][:, :, :, :, :6]}, "page size"),
        (lambda a: {**a, "kv_cache": jnp.tile(a["kv_cache"], (1, 2, 1, 1, 1, 1))}, "kv_cache"),
        (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.int16)}, "block_tables"),
        (lambda a: {**a, "block_tables": a["block_tables"][:-1]}, "seq_lens"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].astype(jnp.float32)}, "seq_lens"),
        (lambda a: {**a, "layer": jnp.zeros((2,), jnp.int32)}, "layer"),
        (lambda a: {**a, "layer": NUM_LAYERS}, "out of range"),
        (lambda a: {**a, "layer": jnp.int32(-1)}, "out of range"),
    ],
)
def test_decode_rejects_bad_inputs_with_a_clear_error(change, message):
    q, kv_cache, layer, block_tables, seq_lens = _case(5, [3, 9], 2, 64, jnp.float32)
    args = {
        "q": q,
        "kv_cache": kv_cache,
        "layer": layer,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**change(args), sm_scale=0.1, interpret=True)


def test_decode_rejects_zero_kv_splits():
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_decode_attention(*_case(6, [3], 1, 64, jnp.float32), sm_scale=0.1, num_kv_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled Triton kernel)"
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_planes", [2, 1], ids=["two_planes", "one_plane"])
def test_decode_compiled_on_gpu_matches_reference(num_planes, dtype):
    q, kv_cache, *rest = _case(7, SEQ_LENS, 4, 128, dtype)
    args = (q, kv_cache[:, :num_planes], *rest)
    out = jax.jit(functools.partial(paged_decode_attention, sm_scale=0.1))(*args)
    ref = paged_decode_attention_reference(*args, sm_scale=0.1)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol
    )
