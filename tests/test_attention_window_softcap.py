"""Both attention backends with what Gemma 2/3 and windowed Mistral need (a per-layer sliding
window given as a traced value, logit soft-capping, head_dim 256) against a dense attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention.backends import get_attention
from jvllm.attention.metadata import AttentionMetadata, build_tiles
from jvllm.worker.buckets import Bucket

# Page size per backend: the kernels need 8 or more.
BLOCK_SIZE = {"reference": 4, "pallas": 8}
# A multiple of the reference backend's page chunks (256 and 64 positions / B).
MAX_PAGES = 256
NUM_LAYERS = 2
GLOBAL = 2**30  # what a global layer of a model with windowed layers passes

# (tile_q, [(kv length after the step, queries this step)]): contexts of several page chunks and
# window blocks, so that a window of 100 leaves whole chunks and blocks out.
CASES = {
    "decode": (1, [(700, 1), (300, 1), (5, 1), (1000, 1), (257, 1), (64, 1)]),
    # fresh prompts, prompts resuming from earlier pages (chunked prefill), decodes beside them
    "mixed": (
        16,
        [(1, 1), (40, 37), (9, 3), (300, 290), (200, 64), (700, 1), (130, 130), (520, 100)],
    ),
}
# Smaller steps for the Pallas kernels, which run interpreted here.
SMALL_CASES = {
    "decode": (1, [(200, 1), (33, 1), (5, 1), (130, 1)]),
    "mixed": (16, [(1, 1), (40, 37), (9, 3), (150, 90), (70, 1), (33, 33)]),
}


def _dense(q, k, v, q_pos, scale, window, softcap):
    """q [Q, N, H], k/v [C, K, H] of one sequence; the query at p sees p - window < j <= p.
    Keys before every query's window are left out (they may be NaN: see _poison_before_windows)."""
    first = 0 if window is None else max(0, int(q_pos.min()) - window + 1)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k[first:], group, axis=1), np.repeat(v[first:], group, axis=1)
    s = np.einsum("qnh,cnh->nqc", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    kv_pos = first + np.arange(k.shape[0])[None, :]
    visible = kv_pos <= q_pos[:, None]
    if window is not None:
        visible &= kv_pos > q_pos[:, None] - window
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqc,cnh->qnh", p, v)


def _step(seqs, tile_q, num_kv_heads, head_dim, dtype, rng, backend):
    """A random step for `backend`: (kv_cache, q, k, v, md, tables), q/k/v [T, *, H] in `dtype`;
    the reference backend's cache holds bfloat16 as its uint16 bits (as the engine's does)."""
    block_size = BLOCK_SIZE[backend]
    num_heads = 3 * num_kv_heads
    num_pages = 1 + sum(-(-kv // block_size) for kv, _ in seqs)
    perm = rng.permutation(np.arange(1, num_pages))  # shuffled pages, null page 0 unused
    tables = np.zeros((len(seqs), MAX_PAGES), np.int32)
    used = 0
    for s, (kv_len, _) in enumerate(seqs):
        n = -(-kv_len // block_size)
        tables[s, :n] = perm[used : used + n]
        used += n
    shape = (NUM_LAYERS, 2, num_kv_heads, num_pages, block_size, head_dim)
    kv_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    if backend == "reference" and dtype == jnp.bfloat16:
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, jnp.uint16)
    q_lens = np.array([n for _, n in seqs])
    seq_lens = np.array([kv for kv, _ in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    q, k, v = (
        jnp.asarray(rng.standard_normal((num_tokens, n, head_dim)), dtype)
        for n in (num_heads, num_kv_heads, num_kv_heads)
    )
    pos = np.concatenate([np.arange(kv - n, kv) for kv, n in seqs])
    seq_of = np.repeat(np.arange(len(seqs)), q_lens)
    slots = tables[seq_of, pos // block_size] * block_size + pos % block_size
    groups = Bucket(num_tokens, len(seqs), tile_q).tile_groups
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(qsl),
        logits_indices=jnp.asarray(qsl[1:] - 1),
        tiles=jax.tree.map(jnp.asarray, build_tiles(qsl, seq_lens, len(seqs), groups)),
    )
    return kv_cache, q, k, v, md, tables


def _poison_before_windows(kv_cache, layer, tables, seqs, window):
    """NaN in the first page of each sequence whose step's first query sees nothing before
    position 256, a whole page chunk of both page walks: a walk that started at the beginning
    instead of at its window would turn the output NaN."""
    cache = np.array(kv_cache)
    nan = 0x7FC0 if cache.dtype == np.uint16 else np.nan  # bfloat16 NaN as its bits
    for s, (kv_len, n) in enumerate(seqs):
        if kv_len - n - window + 1 >= 256:
            cache[layer, :, :, tables[s, 0]] = nan
    return jnp.asarray(cache)


def _as_f32(x):
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return np.asarray(x.astype(jnp.float32), np.float64)


@functools.cache
def _attention(backend: str, scale: float, softcap: float | None):
    """Jitted with the window as an argument: traced, as the model's layer scan passes it."""
    attn = get_attention(backend, scale, logit_softcap=softcap)
    return jax.jit(
        lambda layer, q, k, v, cache, md, window: attn(layer, q, k, v, cache, md, window)
    )


def _check(
    case, *, window, softcap=None, head_dim=8, dtype=jnp.float32, scale=None, backend="reference"
):
    tile_q, seqs = (SMALL_CASES if backend == "pallas" else CASES)[case]
    rng = np.random.default_rng(len(case) + head_dim)
    kv_cache, q, k, v, md, tables = _step(seqs, tile_q, 2, head_dim, dtype, rng, backend)
    scale = head_dim**-0.5 if scale is None else scale
    layer = 1
    if window is not None:
        kv_cache = _poison_before_windows(kv_cache, layer, tables, seqs, window)
    w = None if window is None else jnp.int32(window)
    out, cache = _attention(backend, scale, softcap)(jnp.int32(layer), q, k, v, kv_cache, md, w)
    out, cache, q = np.asarray(out.astype(jnp.float32)), _as_f32(cache), _as_f32(q)
    qsl = np.asarray(md.query_start_loc)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for s, (kv_len, n) in enumerate(seqs):
        pages = tables[s, : -(-kv_len // BLOCK_SIZE[backend])]
        keys, values = (
            cache[layer, i][:, pages].transpose(1, 2, 0, 3).reshape(-1, 2, head_dim)[:kv_len]
            for i in (0, 1)
        )
        q_pos = np.arange(kv_len - n, kv_len)
        want = _dense(q[qsl[s] : qsl[s + 1]], keys, values, q_pos, scale, window, softcap)
        np.testing.assert_allclose(out[qsl[s] : qsl[s + 1]], want, rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("window", [1, 37, 100, GLOBAL])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_with_a_sliding_window_matches_dense(case, window):
    _check(case, window=window)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_with_logit_softcap_matches_dense(case):
    # scale 1 with H = 8: scores of several units, where a cap of 3 bends them
    _check(case, window=None, softcap=3.0, scale=1.0)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_with_window_and_softcap_in_bfloat16(case):
    _check(case, window=100, softcap=3.0, scale=0.5, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(64, jnp.bfloat16), (128, jnp.float32), (256, jnp.float32), (256, jnp.bfloat16)],
)
@pytest.mark.parametrize("case", list(CASES))
def test_reference_backend_with_wide_heads(case, head_dim, dtype):
    _check(case, window=100, softcap=50.0, head_dim=head_dim, dtype=dtype)


def test_reference_backend_global_window_equals_no_window():
    np.testing.assert_allclose(
        _check("mixed", window=GLOBAL), _check("mixed", window=None), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_pallas_backend_with_window_and_softcap_matches_dense(case, dtype):
    _check(case, window=37, softcap=3.0, scale=0.5, dtype=dtype, backend="pallas")


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_pallas_backend_with_wide_heads(case, head_dim):
    _check(case, window=37, head_dim=head_dim, backend="pallas")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_window_is_a_scanned_per_layer_input(backend):
    """As a model with local and global layers runs them: one scan over (layer, window), the
    cache carried, each layer attending with its own window."""
    tile_q, seqs = SMALL_CASES["mixed"]
    rng = np.random.default_rng(3)
    kv_cache, q, k, v, md, _ = _step(seqs, tile_q, 2, 8, jnp.float32, rng, backend)
    attn = get_attention(backend, 8**-0.5)
    windows = jnp.array([5, GLOBAL], jnp.int32)

    def layer_body(cache, layer_and_window):
        layer, window = layer_and_window
        out, cache = attn(layer, q, k, v, cache, md, sliding_window=window)
        return cache, out

    scan = jax.jit(lambda c: jax.lax.scan(layer_body, c, (jnp.arange(NUM_LAYERS), windows)))
    _, outs = scan(kv_cache)
    for layer, window in enumerate(windows):
        alone = _attention(backend, 8**-0.5, None)(jnp.int32(layer), q, k, v, kv_cache, md, window)
        np.testing.assert_allclose(outs[layer], alone[0], rtol=1e-5, atol=1e-5)


def test_backends_reject_a_bad_softcap_or_window():
    with pytest.raises(ValueError, match="logit_softcap"):
        get_attention("reference", 0.1, logit_softcap=-1.0)
    tile_q, seqs = SMALL_CASES["decode"]
    for backend in ("reference", "pallas"):
        rng = np.random.default_rng(0)
        kv_cache, q, k, v, md, _ = _step(seqs, tile_q, 2, 8, jnp.float32, rng, backend)
        attn = get_attention(backend, 0.1)
        with pytest.raises(ValueError, match="sliding_window"):
            attn(jnp.int32(0), q, k, v, kv_cache, md, sliding_window=jnp.float32(4))
