"""spec_decode/ngram_device.py: the device's n-gram drafts equal the host's rule
(spec_decode/ngram.py) row by row, on random token histories with repeats and garbage past
each row's length."""

import jax
import numpy as np
import pytest

from jvllm.spec_decode.ngram import propose_ngram_drafts
from jvllm.spec_decode.ngram_device import propose_ngram_on_device


@pytest.mark.parametrize(("min_n", "max_n", "num_drafts"), [(1, 3, 4), (2, 4, 3), (3, 5, 2)])
def test_device_drafts_equal_the_hosts(min_n, max_n, num_drafts):
    rng = np.random.default_rng(min_n * 10 + max_n)
    num_rows, width = 64, 40
    # Small vocabularies make n-grams recur; short rows test the length bounds.
    history = rng.integers(0, rng.integers(2, 6, (num_rows, 1)), (num_rows, width))
    lengths = rng.integers(1, width + 1, num_rows)
    lengths[:4] = [1, 2, min_n + 1, width]
    propose = jax.jit(propose_ngram_on_device, static_argnums=(2, 3, 4))
    drafts, counts = propose(
        history.astype(np.int32), lengths.astype(np.int32), min_n, max_n, num_drafts
    )
    drafts, counts = np.asarray(drafts), np.asarray(counts)
    found = 0
    for row in range(num_rows):
        expected = propose_ngram_drafts(history[row, : lengths[row]], min_n, max_n, num_drafts)
        assert counts[row] == len(expected), row
        assert drafts[row, : counts[row]].tolist() == expected, row
        assert not drafts[row, counts[row] :].any(), row
        found += bool(expected)
    assert 0 < found < num_rows  # rows with drafts and rows without
