"""The sampler's device functions on hand-made logits: penalties against a NumPy reference of
vLLM's definitions, and sampled frequencies against the distributions the filters define."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.sample.metadata import SamplingMetadata
from jvllm.sample.penalties import apply_penalties, token_counts
from jvllm.sample.sampler import apply_top_k_top_p_min_p, inverse_cdf, sample

VOCAB = 8
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def _metadata(num_seqs: int, **fields) -> SamplingMetadata:
    defaults = {
        "temperature": np.ones(num_seqs, np.float32),
        "top_k": np.zeros(num_seqs, np.int32),
        "top_p": np.ones(num_seqs, np.float32),
        "min_p": np.zeros(num_seqs, np.float32),
        "seeds": np.arange(num_seqs, dtype=np.uint32),
        "output_index": np.zeros(num_seqs, np.int32),
        "presence_penalty": np.zeros(num_seqs, np.float32),
        "frequency_penalty": np.zeros(num_seqs, np.float32),
        "repetition_penalty": np.ones(num_seqs, np.float32),
        "num_prompt_tokens": np.zeros(num_seqs, np.int32),
        "bias_slot": np.zeros(num_seqs, np.int32),
        "prompt_target_ids": np.full(num_seqs, -1, np.int32),
        "token_bitmask": np.full((num_seqs, 1), -1, np.int32),
        "all_greedy": np.bool_(False),
        "any_filter": np.bool_(True),
        "any_penalties": np.bool_(False),
        "any_bias": np.bool_(False),
        "any_constrained": np.bool_(False),
        "any_logprobs": np.bool_(False),
        "any_prompt_logprobs": np.bool_(False),
    }
    for name, value in fields.items():
        defaults[name] = np.full(num_seqs, value, defaults[name].dtype)
    return SamplingMetadata(**defaults)


def _kept(logits: np.ndarray, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """vLLM's filters written out plainly, in float64: top-k, then top-p over the renormalised
    top-k set, then min-p against the most likely token -> bool mask of the allowed tokens."""
    logits = logits.astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(logits.size, bool)
    keep[order[: top_k or logits.size]] = True
    p = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    mass = 0.0
    for i in order:
        if keep[i]:
            if mass >= top_p:
                keep[i] = False
            mass += p[i]
    return keep & (probs >= min_p * probs.max())


def _expected_probs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    probs = np.exp(LOGITS / temperature) / np.exp(LOGITS / temperature).sum()
    out = np.where(_kept(LOGITS / temperature, top_k, top_p, min_p), probs, 0)
    return out / out.sum()


@pytest.mark.parametrize(
    "filters",
    [
        {"temperature": 1.0},
        {"temperature": 0.5},
        {"temperature": 2.0},
        {"top_k": 3},
        {"top_p": 0.7},
        {"top_k": 5, "top_p": 0.8},
        {"min_p": 0.2},
        {"temperature": 1.5, "top_k": 6, "min_p": 0.05},
    ],
)
def test_sampled_frequencies_match_the_filtered_distribution(filters):
    num_draws = 20000
    md = _metadata(num_draws, **filters)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (num_draws, VOCAB))
    counts = np.bincount(np.asarray(sample(logits, md)), minlength=VOCAB)
    expected = _expected_probs(**filters)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    observed, wanted = counts[support], num_draws * expected[support]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = max(int(support.sum()) - 1, 1)
    # Far beyond the 1e-6 tail of chi-square(dof); an off-by-one mask scores in the hundreds.
    assert chi2 < dof + 10 * math.sqrt(2 * dof), (chi2, counts, expected)


# (logit scale, top_k, top_p, min_p): rows whose kept set lies among the 256 largest logits, and
# rows that need the full sort (a wide nucleus, a large top-k).
_LARGE_VOCAB_ROWS = [
    (5.0, 50, 1.0, 0.0),
    (5.0, 0, 0.9, 0.0),
    (0.5, 0, 0.95, 0.0),
    (1.0, 1000, 1.0, 0.0),
    (3.0, 0, 1.0, 0.1),
    (1.0, 0, 1.0, 0.0),
    (2.0, 20, 0.5, 0.05),
]


def test_filters_on_a_large_vocabulary_match_the_reference_in_any_batch():
    vocab = 4096
    rng = np.random.default_rng(3)
    logits = np.stack([rng.normal(0, scale, vocab) for scale, *_ in _LARGE_VOCAB_ROWS])
    logits = logits.astype(np.float32)

    def masks(rows):
        md = _metadata(len(rows))
        md = dataclasses.replace(
            md,
            top_k=np.array([_LARGE_VOCAB_ROWS[r][1] for r in rows], np.int32),
            top_p=np.array([_LARGE_VOCAB_ROWS[r][2] for r in rows], np.float32),
            min_p=np.array([_LARGE_VOCAB_ROWS[r][3] for r in rows], np.float32),
        )
        return np.isfinite(np.asarray(apply_top_k_top_p_min_p(jnp.asarray(logits[rows]), md)))

    together = masks(list(range(len(_LARGE_VOCAB_ROWS))))
    for r, (_, top_k, top_p, min_p) in enumerate(_LARGE_VOCAB_ROWS):
        want = _kept(logits[r], top_k, top_p, min_p)
        np.testing.assert_array_equal(together[r], want, err_msg=f"row {r}")
        # Alone, a row that fits in the candidates skips the full sort: the same mask.
        np.testing.assert_array_equal(masks([r])[0], want, err_msg=f"row {r} alone")
    assert together[2].sum() > 256 and together[3].sum() == 1000  # the full sort was needed


def test_seeded_draws_do_not_depend_on_the_batch():
    md = _metadata(4, seeds=7)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (4, VOCAB))
    tokens = np.asarray(sample(logits, md))
    assert (tokens == tokens[0]).all()


def _reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's definitions, one row at a time."""
    logits = logits.copy()
    counts = (
        np.bincount(output, minlength=logits.size).astype(np.float32)
        if output
        else np.zeros(logits.size, np.float32)
    )
    seen = set(prompt) | set(output)
    for t in seen:
        logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
    logits -= frequency * counts
    logits -= presence * (counts > 0)
    return logits


def test_penalties_match_vllm_definitions_on_hand_made_logits():
    rng = np.random.default_rng(0)
    vocab, block_size, max_pages = 16, 4, 4
    rows = [  # (prompt, output, presence, frequency, repetition)
        ([1, 2, 3], [3, 3, 5], 0.5, 0.0, 1.0),
        ([4, 4, 7, 9, 10], [7, 1], 0.0, 0.7, 1.0),
        ([0, 15], [2, 2, 2, 14], 0.0, 0.0, 1.8),
        ([6, 8, 6, 11, 12, 13], [8, 6, 6, 0, 0], -0.4, 0.3, 0.6),
        ([5], [], 1.0, 1.0, 2.0),
    ]
    num_seqs = len(rows)
    logits = rng.normal(0, 2, size=(num_seqs, vocab)).astype(np.float32)
    # A paged token cache as the engine keeps it: request s owns pages 1 + s*max_pages ...
    token_cache = np.zeros((1 + num_seqs * max_pages, block_size), np.int32)
    block_tables = np.zeros((num_seqs, max_pages), np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    num_prompt = np.zeros(num_seqs, np.int32)
    for s, (prompt, output, *_) in enumerate(rows):
        tokens = prompt + output
        pages = 1 + s * max_pages + np.arange(max_pages)
        block_tables[s] = pages
        token_cache[pages] = np.pad(tokens, (0, max_pages * block_size - len(tokens))).reshape(
            max_pages, block_size
        )
        seq_lens[s], num_prompt[s] = len(tokens), len(prompt)
    counts, prompt_mask = token_counts(token_cache, block_tables, seq_lens, num_prompt, vocab)
    got = apply_penalties(
        jnp.asarray(logits),
        counts,
        prompt_mask,
        jnp.asarray([r[2] for r in rows], jnp.float32),
        jnp.asarray([r[3] for r in rows], jnp.float32),
        jnp.asarray([r[4] for r in rows], jnp.float32),
    )
    want = np.stack([_reference_penalties(logits[s], *rows[s]) for s in range(num_seqs)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    rng = np.random.default_rng(5)
    vocab = 1000  # not a multiple of the search's block
    weights = rng.exponential(1.0, (64, vocab)).astype(np.float32)
    weights[rng.random((64, vocab)) < 0.7] = 0.0  # filtered-out tokens
    weights[:, 999] = 0.0  # the last token can never be chosen
    u = rng.random(64).astype(np.float32)
    u[:4] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 1e-9]
    tokens = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.asarray(u)))
    rows = np.arange(64)
    assert (weights[rows, tokens] > 0).all()
    ends = np.cumsum(weights.astype(np.float64), axis=1)
    target = u * ends[:, -1]
    starts = ends[rows, tokens] - weights[rows, tokens]
    slack = 1e-5 * ends[:, -1]  # float32 running sums
    assert (starts - slack <= target).all() and (target <= ends[rows, tokens] + slack).all()


def test_sampled_frequencies_on_a_vocabulary_of_many_blocks():
    num_draws, vocab = 20000, 600
    logits = np.random.default_rng(4).normal(0.0, 1.0, vocab).astype(np.float32)
    md = dataclasses.replace(_metadata(num_draws), any_filter=np.bool_(False))
    counts = np.bincount(
        np.asarray(sample(jnp.broadcast_to(jnp.asarray(logits), (num_draws, vocab)), md)),
        minlength=vocab,
    )
    expected = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum()
    wanted = num_draws * expected
    chi2 = float(((counts - wanted) ** 2 / wanted).sum())
    dof = vocab - 1
    assert chi2 < dof + 10 * math.sqrt(2 * dof), chi2
