"""The native CPU decode attention kernel against dense attention, and the pure-JAX path with
it off."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.attention import cpu_decode
from jvllm.attention.metadata import Tiles

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None, reason="builds the kernel with the system C++ compiler"
)


def _dense(q, k, v):
    """q [N, H] of one token to k, v [C, K, H] -> [N, H]."""
    group = q.shape[0] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [C, N, H]
    s = np.einsum("nh,cnh->nc", q, k)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nc,cnh->nh", p / p.sum(-1, keepdims=True), v)


@needs_compiler
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size", "num_planes"),
    [
        (jnp.bfloat16, 9, 3, 64, 16, 2),  # SmolLM2's shapes
        (jnp.float32, 9, 3, 64, 16, 2),
        (jnp.float32, 8, 2, 128, 16, 2),  # Llama-3's head size
        (jnp.bfloat16, 8, 2, 128, 8, 2),  # runs of 16 rows over two pages
        (jnp.bfloat16, 14, 2, 64, 32, 2),  # 7 query heads a KV head: in groups of 4 and 3
        (jnp.bfloat16, 8, 1, 128, 16, 2),  # 8 query heads of size 128: values in groups of 2
        (jnp.bfloat16, 4, 4, 64, 3, 2),  # no grouping; pages of 3 rows
        (jnp.float32, 10, 2, 64, 16, 2),  # 5 query heads a KV head: groups of 4 and 1
        (jnp.float32, 6, 6, 40, 4, 2),  # a head size the kernel does not special-case
        (jnp.bfloat16, 6, 3, 96, 16, 2),
        (jnp.bfloat16, 16, 1, 40, 16, 1),  # MLA's latent: one plane, the keys are the values
        (jnp.float32, 8, 1, 64, 8, 1),
    ],
)
def test_kernel_matches_dense_attention_on_ragged_pages(
    dtype, num_heads, num_kv_heads, head_dim, block_size, num_planes
):
    rng = np.random.default_rng(head_dim)
    lens = [1, 2, block_size, block_size + 1, 77, 300, 513, 5]
    num_layers, layer = 3, 2
    max_pages = max(-(-n // block_size) for n in lens) + 3
    num_pages = 1 + sum(-(-n // block_size) for n in lens) + 7
    tables = np.zeros((len(lens), max_pages), np.int32)
    free = rng.permutation(np.arange(1, num_pages))  # shuffled pages, the null page unused
    for s, n in enumerate(lens):
        tables[s, : -(-n // block_size)], free = np.split(free, [-(-n // block_size)])
    shape = (num_layers, num_planes, num_kv_heads, num_pages, block_size, head_dim)
    cache = jnp.asarray(rng.standard_normal(shape), dtype)
    values = np.asarray(cache.astype(jnp.float32))
    if dtype == jnp.bfloat16:  # stored as bits, as the engine does
        cache = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    assert cpu_decode.supports(cache)
    # Tokens in another order than their sequences, two padding tiles (token 0, reads nothing)
    # and a token that no tile reads.
    num_tokens = len(lens) + 1
    token_of = rng.permutation(np.arange(1, num_tokens))
    tiles = Tiles(
        token_idx=jnp.asarray(np.r_[token_of, 0, 0][:, None], jnp.int32),
        kv_lens=jnp.asarray(np.r_[lens, 0, 0][:, None], jnp.int32),
        seq=jnp.asarray(np.r_[np.arange(len(lens)), 0, 0], jnp.int32),
    )
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32) / 4

    no_pages = (  # what the pure-JAX path starts from: (MASKED, 0, 0)
        jnp.full(q.shape[:2], -1e30),
        jnp.zeros(q.shape[:2]),
        jnp.zeros(q.shape),
    )
    found = jax.jit(cpu_decode.attend_pages)(
        jnp.asarray(q), cache, jnp.int32(layer), jnp.asarray(tables), tiles, no_pages
    )

    m, l, acc = (np.asarray(x) for x in found)
    # no tile reads token 0: it keeps the "no pages" it came with
    np.testing.assert_array_equal(m[0], np.float32(-1e30))
    np.testing.assert_array_equal(l[0], 0)
    np.testing.assert_array_equal(acc[0], 0)
    out = acc / np.where(l > 0, l, 1)[..., None]
    for s, n in enumerate(lens):
        pages = tables[s, : -(-n // block_size)]
        k, v = (
            values[layer, kv][:, pages].transpose(1, 2, 0, 3).reshape(-1, num_kv_heads, head_dim)
            for kv in (0, num_planes - 1)
        )
        want = _dense(q[token_of[s]], k[:n], v[:n])
        np.testing.assert_allclose(out[token_of[s]], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ["decode", "many_decodes", "mixed", "long_prefills"])
def test_pure_jax_paged_attention_still_matches_dense_with_the_kernel_off(case, dtype, monkeypatch):
    """JVLLM_CPU_DECODE_KERNEL=0 (or no compiler) keeps the reference backend's own attention
    of one-query tiles, which the other tests of it no longer reach on a CPU with the kernel."""
    from test_attention_reference import _check_against_dense

    monkeypatch.setenv("JVLLM_CPU_DECODE_KERNEL", "0")
    assert not cpu_decode.supports(jnp.zeros((1, 2, 1, 1, 1, 1), jnp.float32))
    jax.clear_caches()  # paged_attention traces again, without the kernel
    try:
        _check_against_dense(case, 6, 2, dtype)
    finally:
        jax.clear_caches()


@needs_compiler
def test_loading_the_kernel_leaves_float_arithmetic_alone():
    """A library linked with -ffast-math turns on flush-to-zero in the thread that loads it:
    denormals would become 0 there, and JAX would fold different constants into the steps that
    thread traces (different compilation-cache keys from one process to the next)."""
    script = (
        "import numpy as np; from jvllm.attention import cpu_decode\n"
        "tiny = np.float32(1e-39)\n"
        "assert tiny * np.float32(1) != 0\n"
        "assert cpu_decode._register(np.float32)\n"
        "assert tiny * np.float32(1) != 0, 'flush-to-zero after loading the kernel'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
