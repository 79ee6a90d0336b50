"""Attention sinks (gpt-oss): a learned per-head logit joins every query's softmax and carries no
value. Each backend, on random ragged steps (decodes, chunked prefills, fresh prompts), with and
without a sliding window and soft cap, against a dense softmax over [scores, sink]."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention_window_softcap import BLOCK_SIZE, SMALL_CASES, _as_f32, _step

from jvllm.attention.backends import get_attention
from jvllm.attention.kv_pages import write_kv
from kernels_pallas import paged_decode_attention_reference, ragged_paged_attention_reference

NUM_KV_HEADS, GROUP = 2, 3


def _dense_with_sinks(q, k, v, q_pos, scale, window, softcap, sinks):
    """q [Q, N, H], k/v [C, K, H] of one sequence, sinks [N]: HF's eager gpt-oss attention (the
    sink appended as a last, unscaled column of the logits, its probability dropped)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qnh,cnh->nqc", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    kv_pos = np.arange(k.shape[0])[None, :]
    visible = kv_pos <= q_pos[:, None]
    if window is not None:
        visible &= kv_pos > q_pos[:, None] - window
    s = np.where(visible[None], s, -np.inf)
    sink_column = np.broadcast_to(sinks[:, None, None], (*s.shape[:2], 1))
    s = np.concatenate([s, sink_column], axis=-1)  # [N, Q, C + 1]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqc,cnh->qnh", p[..., :-1], v)


def _kernel_references(scale: float, softcap: float | None):
    """The Pallas kernels' pure-jnp references behind the `attn` contract."""

    def attn(layer, q, k, v, kv_cache, md, sliding_window=None, sinks=None):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        args = (q, kv_cache, layer, md.block_tables, md.seq_lens)
        options = {"sm_scale": scale, "sliding_window": sliding_window, "logit_softcap": softcap}
        if md.is_decode:
            return paged_decode_attention_reference(*args, **options, sinks=sinks), kv_cache
        out = ragged_paged_attention_reference(*args, md.query_start_loc, **options, sinks=sinks)
        return out, kv_cache

    return attn


@functools.cache
def _attention(backend: str, scale: float, softcap: float | None):
    """Jitted with the window and the sinks as arguments: traced, as the layer scan passes them."""
    if backend == "kernel_references":
        attn = _kernel_references(scale, softcap)
    else:
        attn = get_attention(backend, scale, logit_softcap=softcap)
    return jax.jit(
        lambda layer, q, k, v, cache, md, window, sinks: attn(
            layer, q, k, v, cache, md, sliding_window=window, sinks=sinks
        )
    )


def _sinks(rng) -> np.ndarray:
    """Per-head sinks from well below to well above the scores' usual max (about 3 here), so
    that some heads give the sink most of the probability and others almost none."""
    return rng.uniform(-2.0, 6.0, NUM_KV_HEADS * GROUP).astype(np.float32)


def _check(case, *, window=None, softcap=None, dtype=jnp.float32, backend="reference"):
    layout = "reference" if backend == "reference" else "pallas"  # page size, cache dtype
    tile_q, seqs = SMALL_CASES[case]  # the sinks join where the softmax ends: short ones will do
    head_dim, layer, scale = 8, 1, 0.5
    rng = np.random.default_rng(len(case))
    kv_cache, q, k, v, md, tables = _step(seqs, tile_q, NUM_KV_HEADS, head_dim, dtype, rng, layout)
    sinks = _sinks(rng)
    w = None if window is None else jnp.int32(window)
    attn = _attention(backend, scale, softcap)
    out, cache = attn(jnp.int32(layer), q, k, v, kv_cache, md, w, jnp.asarray(sinks))
    out, cache, q = np.asarray(out.astype(jnp.float32)), _as_f32(cache), _as_f32(q)
    qsl = np.asarray(md.query_start_loc)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for s, (kv_len, n) in enumerate(seqs):
        pages = tables[s, : -(-kv_len // BLOCK_SIZE[layout])]
        keys, values = (
            cache[layer, i][:, pages].transpose(1, 2, 0, 3).reshape(-1, 2, head_dim)[:kv_len]
            for i in (0, 1)
        )
        q_pos = np.arange(kv_len - n, kv_len)
        want = _dense_with_sinks(
            q[qsl[s] : qsl[s + 1]], keys, values, q_pos, scale, window, softcap, sinks
        )
        np.testing.assert_allclose(out[qsl[s] : qsl[s + 1]], want, rtol=tol, atol=tol)


# Decode steps without a window or cap run the CPU decode kernel (in float32 and bfloat16); with
# either they run the pure-JAX page walk. Mixed steps cover the window of the step's own tokens,
# the pages of chunked prefills, and decodes beside them.
@pytest.mark.parametrize(
    ("case", "window", "softcap", "dtype"),
    [
        ("decode", None, None, jnp.float32),
        ("decode", None, None, jnp.bfloat16),
        ("decode", 37, 3.0, jnp.float32),
        ("mixed", None, None, jnp.float32),
        ("mixed", 37, 3.0, jnp.bfloat16),
    ],
)
def test_reference_backend_with_sinks_matches_dense(case, window, softcap, dtype):
    _check(case, window=window, softcap=softcap, dtype=dtype)


@pytest.mark.parametrize("backend", ["pallas", "kernel_references"])
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_pallas_kernels_and_their_references_with_sinks_match_dense(case, backend):
    """The decode kernel merges the sinks with its splits, the ragged one folds them into each
    tile's rows (interpreted here, and small: that is slow)."""
    _check(case, window=37, softcap=3.0, backend=backend)


def test_sinks_must_hold_one_logit_per_query_head():
    tile_q, seqs = SMALL_CASES["decode"]
    rng = np.random.default_rng(0)
    kv_cache, q, k, v, md, _ = _step(seqs, tile_q, NUM_KV_HEADS, 8, jnp.float32, rng, "reference")
    attn = get_attention("reference", 0.1)
    with pytest.raises(ValueError, match=r"sinks must be None or one logit per query head"):
        attn(jnp.int32(0), q, k, v, kv_cache, md, sinks=jnp.zeros(NUM_KV_HEADS))
