"""The engine's tiled reference attention against a dense, obviously-correct attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.kv_pages import write_kv
from jvllm.attention.kv_quant import (
    QuantizedKVCache,
    bits_dtype,
    dequantize,
    kv_values,
    quantize,
    quantized_dtype,
    to_storage,
)
from jvllm.attention.metadata import AttentionMetadata, build_tiles, paged_kv_lens
from jvllm.attention.reference import paged_attention
from jvllm.worker.buckets import Bucket


def _dense_attention(q, k, v, q_pos, scale):
    """q [Q, N, H], k/v [C, K, H] of one sequence; query at q_pos sees kv positions <= q_pos."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qnh,cnh->nqc", q, k) * scale
    s = np.where(np.arange(k.shape[0])[None, None] <= q_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqc,cnh->qnh", p, v)


_MANY = np.random.default_rng(7)
CASES = {
    # (kv length after the step, queries this step): decodes, page boundaries, a long prefill
    "decode": (1, [(1, 1), (4, 1), (5, 1), (33, 1), (17, 1)]),
    "mixed": (16, [(1, 1), (4, 4), (5, 1), (40, 37), (9, 3), (16, 16)]),
    # more tiles than one tile block: several blocks, the last one partly padding
    "many_decodes": (1, [(int(n), 1) for n in _MANY.integers(1, 9, 45)]),
    "many_mixed": (16, [(int(n), min(int(n), 20)) for n in _MANY.integers(1, 25, 30)]),
    # prompts longer than two window blocks, starting mid-block, with and without context from
    # earlier steps (read from the pages), next to a decode
    "long_prefills": (16, [(300, 290), (150, 150), (70, 1), (200, 64), (9, 9)]),
    # more query blocks walking earlier blocks than one group holds, of several depths
    "deep_prefills": (16, [(400, 400), (300, 233), (3, 1), (260, 259), (20, 20)]),
    # one long prompt, starting mid-block: more (query block, span) pairs than one pass holds
    "many_passes": (16, [(60, 59), (900, 880), (3, 1)]),
    # fresh prompts, short and long: every key is the step's own, no query reads the pages
    "fresh_prompts": (16, [(40, 40), (24, 24), (64, 64), (330, 330)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_tiled_paged_attention_matches_dense_on_ragged_batches(case, num_heads, num_kv_heads):
    _check_against_dense(case, num_heads, num_kv_heads, jnp.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_cache_matches_dense_within_bfloat16_error(case):
    """A bfloat16 model's cache (uint16 bits): one-query tiles in float32, the others in
    bfloat16 with float32 accumulation."""
    _check_against_dense(case, 6, 2, jnp.bfloat16)


@pytest.mark.parametrize(
    ("case", "kv_cache_dtype", "dtype"),
    [
        ("decode", "fp8", jnp.float32),
        ("long_prefills", "fp8", jnp.bfloat16),
        ("decode", "int8", jnp.bfloat16),
        ("mixed", "int8", jnp.float32),
    ],
)
def test_quantized_cache_matches_dense_over_what_the_cache_holds(case, kv_cache_dtype, dtype):
    """A quantized cache (as stored on CPU: float8 and bfloat16 as bits) gives dense attention
    over its dequantized pages, and, in steps with prefills, over the step's own k, v as given."""
    _check_against_dense(case, 6, 2, dtype, kv_cache_dtype)


@pytest.mark.parametrize(
    ("case", "dtype", "kv_cache_dtype"),
    [
        ("decode", jnp.float32, "auto"),
        ("mixed", jnp.bfloat16, "auto"),
        ("long_prefills", jnp.float32, "auto"),
        ("many_decodes", jnp.bfloat16, "int8"),
        ("mixed", jnp.float32, "fp8"),
    ],
)
def test_one_plane_cache_reads_its_keys_as_values(case, dtype, kv_cache_dtype):
    """MLA's latent cache [L, 1, K, P, B, H]: the model passes v = k, one row a token is
    written, and the values read are the keys."""
    _check_against_dense(case, 8, 1, dtype, kv_cache_dtype, num_planes=1)


def _check_against_dense(case, num_heads, num_kv_heads, dtype, kv_cache_dtype="auto", num_planes=2):
    tile_q, seqs = CASES[case]
    rng = np.random.default_rng(len(case) * 100 + num_heads)
    block_size, head_dim, num_pages, num_layers, layer = 4, 8, 256, 2, 1
    max_pages = 256  # a multiple of the decode chunk (256 positions / B)
    perm = rng.permutation(np.arange(1, num_pages))  # shuffled pages, null page 0 unused
    tables = np.zeros((len(seqs), max_pages), np.int32)
    used = 0
    for s, (kv_len, _) in enumerate(seqs):
        n = -(-kv_len // block_size)
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (num_layers, num_planes, num_kv_heads, num_pages, block_size, head_dim)
    kv_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    if kv_cache_dtype != "auto":
        values, scales = quantize(kv_cache, quantized_dtype(kv_cache_dtype))
        kv_cache = QuantizedKVCache(
            to_storage(values, bits_dtype(values.dtype)), to_storage(scales, jnp.uint16)
        )
    elif dtype == jnp.bfloat16:  # stored as its bits, as the engine does (kv_cache_spec)
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, jnp.uint16)
    q_lens = np.array([q for _, q in seqs])
    seq_lens = np.array([kv for kv, _ in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    new_k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    new_v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    if num_planes == 1:
        new_v = new_k
    # What the model passes in: q, k, v in its dtype (the dense reference gets the same values).
    q, new_k, new_v = (
        np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, new_k, new_v)
    )
    pos = np.concatenate([np.arange(kv - ql, kv) for kv, ql in seqs])
    seq_of = np.repeat(np.arange(len(seqs)), q_lens)
    slots = tables[seq_of, pos // block_size] * block_size + pos % block_size
    groups = Bucket(num_tokens, len(seqs), tile_q).tile_groups
    tiles = build_tiles(qsl, seq_lens, len(seqs), groups)
    reads = [(t.kv_lens > 0).any() for t in tiles]
    if case == "fresh_prompts":
        assert not any(reads)  # the window holds every key: the pages are skipped
    if case == "long_prefills":
        assert any(reads) and any((t.kv_lens == 0).any() for t in tiles)  # both halves
    if case in ("mixed", "long_prefills"):
        assert reads == [True, True]  # lone queries in one-query tiles, the others in 16s
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(qsl),
        logits_indices=jnp.asarray(qsl[1:] - 1),
        tiles=jax.tree.map(jnp.asarray, tiles),
    )
    scale = head_dim**-0.5
    layer_idx = jnp.int32(layer)
    q_in, k_in, v_in = (jnp.asarray(x, dtype) for x in (q, new_k, new_v))
    cache = jax.jit(write_kv)(kv_cache, layer_idx, k_in, v_in, md.slot_mapping)
    out = jax.jit(paged_attention, static_argnums=6)(q_in, k_in, v_in, cache, layer_idx, md, scale)
    out = np.asarray(out.astype(jnp.float32))

    if kv_cache_dtype != "auto":
        cache_np = np.asarray(dequantize(cache.values, cache.scales))
    elif cache.dtype == jnp.uint16:
        cache_np = np.asarray(jax.lax.bitcast_convert_type(cache, jnp.bfloat16).astype(jnp.float32))
    else:
        cache_np = np.asarray(cache)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for s, (kv_len, ql) in enumerate(seqs):
        pages = tables[s, : -(-kv_len // block_size)]
        k = cache_np[layer, 0][:, pages].transpose(1, 2, 0, 3).reshape(-1, num_kv_heads, head_dim)
        v = cache_np[layer, num_planes - 1][:, pages]
        v = v.transpose(1, 2, 0, 3).reshape(-1, num_kv_heads, head_dim)
        if not md.is_decode:  # a step with prefills reads its own tokens from k, v
            k[kv_len - ql : kv_len], v[kv_len - ql : kv_len] = (
                x[qsl[s] : qsl[s + 1]] for x in (new_k, new_v)
            )
        want = _dense_attention(
            q[qsl[s] : qsl[s + 1]], k[:kv_len], v[:kv_len], np.arange(kv_len - ql, kv_len), scale
        )
        np.testing.assert_allclose(out[qsl[s] : qsl[s + 1]], want, rtol=tol, atol=tol)
    # the other layer is untouched by the write
    np.testing.assert_array_equal(
        np.asarray(kv_values(cache))[0], np.asarray(kv_values(kv_cache))[0]
    )


@pytest.mark.parametrize(
    "seqs",
    [
        [(int(n), 1) for n in np.random.default_rng(0).integers(1, 300, 40)],  # decode
        [(300, 40), (50, 50), (700, 20), (120, 1), (900, 1), (64, 3), (1000, 130)],  # mixed
    ],
)
def test_tiles_go_longest_read_first_and_hold_each_reading_query_once(seqs):
    """The page loop walks each block of tiles as far as its longest: tiles come sorted."""
    kv_lens, q_lens = (np.array(x, np.int32) for x in zip(*seqs))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    is_decode = (q_lens == 1).all()
    tile_q = 1 if is_decode else 16
    groups = Bucket(int(qsl[-1]), len(seqs), tile_q).tile_groups
    reads = paged_kv_lens(qsl, kv_lens, len(seqs), is_decode)
    placed = {}
    for tiles in build_tiles(qsl, kv_lens, len(seqs), groups):
        longest = tiles.kv_lens.max(axis=1)
        assert (np.diff(longest) <= 0).all()  # longest first, padding (0) last
        for token, kv_len in zip(
            tiles.token_idx[tiles.kv_lens > 0], tiles.kv_lens[tiles.kv_lens > 0]
        ):
            assert token not in placed
            placed[int(token)] = int(kv_len)
    assert placed == {t: int(n) for t, n in enumerate(reads) if n > 0}
