"""rejection_sample on its own (nothing in the engine calls it yet): the tokens it gives at each
output position follow the target's distribution there, whether the draft's distribution agrees
with it often or rarely."""

import math

import jax
import numpy as np
import pytest

from jvllm.sample.rejection import rejection_sample

VOCAB = 6
NUM_DRAFTS = 2
NUM_RUNS = 20_000


def _probs(rng, sharpness: float) -> np.ndarray:
    logits = rng.normal(0, sharpness, VOCAB)
    return np.exp(logits) / np.exp(logits).sum()


def _assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=VOCAB)
    wanted = len(tokens) * probs
    chi2 = float(((counts - wanted) ** 2 / wanted).sum())
    dof = VOCAB - 1
    # Far beyond the 1e-6 tail of chi-square(dof), as tests/test_sampler.py's checks.
    assert chi2 < dof + 10 * math.sqrt(2 * dof), (chi2, counts, wanted)


def _draft_distributions(rng, target: np.ndarray, agree: bool) -> np.ndarray:
    """q at each draft position: p lightly perturbed, or most of its mass on p's least likely
    tokens."""
    if agree:
        q = target[:NUM_DRAFTS] * rng.uniform(0.8, 1.2, (NUM_DRAFTS, VOCAB))
    else:
        q = target[:NUM_DRAFTS] ** -2.0
    return q / q.sum(-1, keepdims=True)


@pytest.mark.parametrize("agree", [True, False], ids=["q_agrees", "q_disagrees"])
def test_rejection_sampled_tokens_follow_the_target_distribution(agree):
    rng = np.random.default_rng(0)
    target = np.stack([_probs(rng, 2.0) for _ in range(NUM_DRAFTS + 1)])  # [K + 1, V]
    draft = _draft_distributions(rng, target, agree)  # [K, V]
    drafts = np.stack(
        [rng.choice(VOCAB, NUM_RUNS, p=draft[i]) for i in range(NUM_DRAFTS)], axis=1
    ).astype(np.int32)  # [S, K]
    # A few requests with fewer drafts: their runs end at once.
    num_drafts = np.where(np.arange(NUM_RUNS) % 10 == 0, 1, NUM_DRAFTS).astype(np.int32)
    args = (
        drafts,
        num_drafts,
        np.broadcast_to(draft, (NUM_RUNS, *draft.shape)).astype(np.float32),
        np.broadcast_to(target, (NUM_RUNS, *target.shape)).astype(np.float32),
        np.arange(NUM_RUNS, dtype=np.uint32),  # seeds
        np.full(NUM_RUNS, 5, np.int32),  # output index
    )
    run = jax.jit(rejection_sample)
    token_ids, num_tokens = (np.asarray(a) for a in run(*args))
    # A request's run depends on its own seed and inputs, not on the batch.
    alone = np.asarray(run(*(a[3:5] for a in args))[0])
    np.testing.assert_array_equal(alone, token_ids[3:5])
    assert np.all((num_tokens >= 1) & (num_tokens <= num_drafts + 1))
    positions = np.arange(NUM_DRAFTS + 1)
    assert np.all((token_ids >= 0) == (positions < num_tokens[:, None]))
    run_is_drafts = (token_ids == np.pad(drafts, ((0, 0), (0, 1)), constant_values=-1)) | (
        positions >= num_tokens[:, None] - 1
    )
    assert run_is_drafts.all()  # every token of a run but the last is its draft
    # The token at output position i, where the run reaches it: a draft q drew independently
    # of the earlier positions, so the run reaching i leaves position i's p unchanged. A
    # request with one draft takes its bonus from position 1's p, as the target would.
    for i in range(NUM_DRAFTS + 1):
        _assert_follows(token_ids[num_tokens > i, i], target[i])
    # The first draft is accepted with probability sum(min(p, q)): most often, or seldom.
    accepted = np.mean(num_tokens > 1)
    wanted = np.minimum(target[0], draft[0]).sum()
    assert (wanted > 0.9) if agree else (wanted < 0.3)
    assert abs(accepted - wanted) < 0.02, (accepted, wanted)
