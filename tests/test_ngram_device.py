"""spec_decode/ngram_device.py: the device's n-gram drafts equal the host's rule
(spec_decode/ngram.py) row by row, on random token histories with repeats and garbage past
each row's length, read in chunks shorter and longer than the rows."""

import jax
import numpy as np
import pytest

from jvllm.spec_decode.ngram import propose_ngram_drafts
from jvllm.spec_decode.ngram_device import dense_tokens, propose_ngram_on_device
from jvllm.worker.spec_window import paged_tokens


@pytest.mark.parametrize(
    ("min_n", "max_n", "num_drafts", "chunk"), [(1, 3, 4, 7), (2, 4, 3, 16), (3, 5, 2, 64)]
)
def test_device_drafts_equal_the_hosts(min_n, max_n, num_drafts, chunk):
    rng = np.random.default_rng(min_n * 10 + max_n)
    num_rows, width = 64, 40
    # Small vocabularies make n-grams recur; short rows test the length bounds.
    history = rng.integers(0, rng.integers(2, 6, (num_rows, 1)), (num_rows, width))
    lengths = rng.integers(1, width + 1, num_rows)
    lengths[:4] = [1, 2, min_n + 1, width]
    # Chunks shorter than the rows (matches across a chunk's edge, a longer n-gram in a later
    # chunk) and longer.
    propose = jax.jit(
        lambda history, lengths: propose_ngram_on_device(
            dense_tokens(history), lengths, min_n, max_n, num_drafts, chunk
        )
    )
    drafts, counts = propose(history.astype(np.int32), lengths.astype(np.int32))
    drafts, counts = np.asarray(drafts), np.asarray(counts)
    found = 0
    for row in range(num_rows):
        expected = propose_ngram_drafts(history[row, : lengths[row]], min_n, max_n, num_drafts)
        assert counts[row] == len(expected), row
        assert drafts[row, : counts[row]].tolist() == expected, row
        assert not drafts[row, counts[row] :].any(), row
        found += bool(expected)
    assert 0 < found < num_rows  # rows with drafts and rows without


def test_a_windows_lookup_through_block_tables_equals_the_hosts():
    """worker/spec_window.paged_tokens: rows longer than a chunk, on pages out of order and of a
    size that does not divide the chunk, the run's last token placed at each row's end."""
    rng = np.random.default_rng(7)
    num_rows, block_size, max_pages = 6, 5, 260  # up to 1300 tokens: three chunks of 512
    history = rng.integers(0, 4, (num_rows, max_pages * block_size)).astype(np.int32)
    tables = 1 + rng.permutation(num_rows * max_pages).reshape(num_rows, max_pages)
    token_cache = np.zeros((1 + num_rows * max_pages, block_size), np.int32)
    token_cache[tables] = history.reshape(num_rows, max_pages, block_size)
    lengths = np.array([1, 2, 300, 513, 1025, max_pages * block_size])
    run_end = rng.integers(0, 4, num_rows).astype(np.int32)
    history[np.arange(num_rows), lengths - 1] = run_end  # not in the cache: placed by the read

    @jax.jit
    def propose(token_cache, tables, lengths, run_end):
        tokens = paged_tokens(token_cache, tables, lengths - 1, run_end)
        return propose_ngram_on_device(tokens, lengths, 2, 4, 3)

    drafts, counts = map(np.asarray, propose(token_cache, tables, lengths, run_end))
    for row in range(num_rows):
        expected = propose_ngram_drafts(history[row, : lengths[row]], 2, 4, 3)
        assert drafts[row, : counts[row]].tolist() == expected, row
        assert counts[row] == len(expected), row
    assert counts[2:].all()


def test_a_longer_ngram_in_a_later_chunk_replaces_a_shorter_one():
    """Chunks of 4: [8 9] recurs in the first chunk, [7 8 9] only in the third; the lookup may
    stop early only once no chunk left could hold a longer n-gram."""
    row = np.array([[8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 0, 7, 8, 9]], np.int32)
    assert propose_ngram_drafts(row[0], 1, 3, 3) == [5, 0, 7]
    lengths = np.array([16], np.int32)
    propose = jax.jit(lambda h, n: propose_ngram_on_device(dense_tokens(h), n, 1, 3, 3, 4))
    drafts, counts = propose(row, lengths)
    assert np.asarray(drafts).tolist() == [[5, 0, 7]] and int(counts[0]) == 3
