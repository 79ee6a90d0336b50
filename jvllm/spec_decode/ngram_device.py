"""n-gram (prompt lookup) drafts on the device, for the rounds of a speculative window
(worker/spec_window.py), which never return to the host between rounds: ngram.py's rule over
every row at once.

The rows' tokens are read through a `RowTokens` (the window reads the token cache through each
row's block table), a chunk of positions at a time, for as many chunks as the longest row
needs: what a round costs follows the rows' lengths, not the block table's width
(max_model_len)."""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Positions a row's lookup reads at once: [S, CHUNK] tokens a chunk.
CHUNK = 512


class RowTokens(NamedTuple):
    """Each row's tokens, read at `at`(positions i32[S, *]) -> i32[S, *], or in a `span`(first
    i32[], width) -> i32[S, width] of the same positions first, first + 1, ... for every row,
    read only before each row's last position. Positions outside a row's tokens give anything,
    without failing."""

    at: Callable[[jax.Array], jax.Array]
    span: Callable[[jax.Array, int], jax.Array]


def dense_tokens(history: jax.Array) -> RowTokens:
    """RowTokens of history i32[S, N] (positions clipped to [0, N))."""
    rows, width = jnp.arange(history.shape[0])[:, None], history.shape[1]
    at = lambda positions: history[rows, jnp.clip(positions, 0, width - 1)]
    return RowTokens(at, lambda first, size: at(first + jnp.arange(size)[None]))


def propose_ngram_on_device(
    tokens: RowTokens,
    lengths: jax.Array,
    min_n: int,
    max_n: int,
    num_drafts: int,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """ngram.propose_ngram_drafts for each row: `tokens` (row s's at [0, lengths[s])), lengths
    i32[S] -> (drafts i32[S, num_drafts], 0 past each row's count; counts i32[S]): the tokens
    after the longest n-gram (min_n <= n <= max_n) ending the row, at its earliest earlier
    occurrence."""
    last = lengths[:, None] - 1  # [S, 1]
    tail = tokens.at(last - jnp.arange(max_n)[None])  # [S, max_n] the tokens n - 1 back from last

    def in_chunk(c):
        """The longest n (0: none) whose n-gram ends a match in chunk c, and its first end."""
        j = c * chunk + jnp.arange(chunk)[None]  # [1, C] the ends j (j < L - 1: a token follows)
        # The chunk's tokens and the max_n - 1 before it, read once: [S, max_n - 1 + C].
        slab = tokens.span(c * chunk - (max_n - 1), max_n - 1 + chunk)
        ends = (j < last) & (slab[:, max_n - 1 :] == tail[:, :1])  # [S, C], n = 1
        found = jnp.any(ends, axis=1)
        best = (jnp.where(found & (min_n <= 1), 1, 0), jnp.argmax(ends, axis=1))

        def longer(carry):  # each n keeps the ends whose token n - 1 back matches too
            n, ends, found, (best_n, best_end) = carry
            back = jax.lax.dynamic_slice_in_dim(tail, n - 1, 1, axis=1)  # [S, 1]
            before = jax.lax.dynamic_slice_in_dim(slab, max_n - n, chunk, axis=1)  # at j - (n - 1)
            ends = ends & (j >= n - 1) & (n <= last) & (before == back)
            found = jnp.any(ends, axis=1)
            longest = found & (n >= min_n)  # a longer n-gram that recurs replaces a shorter one
            best_n = jnp.where(longest, n, best_n)
            return n + 1, ends, found, (best_n, jnp.where(longest, jnp.argmax(ends, 1), best_end))

        def any_left(carry):  # an n <= max_n, and a row whose n - 1 still matches somewhere
            n, _, found, _ = carry
            return (n <= max_n) & jnp.any(found)

        *_, (best_n, best_end) = jax.lax.while_loop(any_left, longer, (2, ends, found, best))
        return best_n, c * chunk + best_end

    def next_chunk(carry):  # a later chunk's match replaces an earlier one only if longer
        c, best_n, best_end = carry
        n, end = in_chunk(c)
        return c + 1, jnp.maximum(n, best_n), jnp.where(n > best_n, end, best_end)

    def could_improve(carry):  # a row with chunks left that could hold a longer n-gram
        c, best_n, _ = carry
        return jnp.any((c * chunk < last[:, 0]) & (best_n < jnp.minimum(max_n, last[:, 0])))

    zeros = jnp.zeros(lengths.shape, jnp.int32)
    _, best_n, best_end = jax.lax.while_loop(could_improve, next_chunk, (0, zeros, zeros))
    start = best_end + 1  # [S] the earliest occurrence's next token
    counts = jnp.where(best_n > 0, jnp.clip(lengths - start, 0, num_drafts), 0)
    offsets = jnp.arange(num_drafts)[None]  # [1, k]
    drafts = tokens.at(start[:, None] + offsets)
    return jnp.where(offsets < counts[:, None], drafts, 0), counts.astype(jnp.int32)
