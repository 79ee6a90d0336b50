"""ragged_paged_attention in interpret mode against its pure-jnp reference (CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
):
    rng = np.random.default_rng(seed)
    seq_lens = [seq_len for seq_len, _ in seqs]
    kv_cache, block_tables = make_paged_kv(
        rng,
        seq_lens,
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        num_pages=NUM_PAGES,
        page_size=page_size,
        head_dim=head_dim,
        max_pages_per_seq=MAX_PAGES,
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
def _kernel(sm_scale: float):
    return jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale, interpret=True))


def _check(args, sm_scale: float = 0.125) -> np.ndarray:
    out = _kernel(sm_scale)(*args)
    ref = ragged_paged_attention_reference(*args, sm_scale=sm_scale)
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
def test_ragged_compiled_on_gpu_matches_reference(dtype):
    args = _case(6, MIXED, 4, 128, dtype)
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
