"""n-gram (prompt lookup) drafts on the device, for the rounds of a speculative window
(worker/spec_window.py), which never return to the host between rounds: ngram.py's rule over
every row at once, each row's tokens read from the token cache."""

import jax
import jax.numpy as jnp


def propose_ngram_on_device(
    history: jax.Array, lengths: jax.Array, min_n: int, max_n: int, num_drafts: int
) -> tuple[jax.Array, jax.Array]:
    """ngram.propose_ngram_drafts for each row: history i32[S, N] (row s's tokens at
    [0, lengths[s]), anything after), lengths i32[S] -> (drafts i32[S, num_drafts], 0 past
    each row's count; counts i32[S]): the tokens after the longest n-gram (min_n <= n <= max_n)
    ending the row, at its earliest earlier occurrence."""
    num_rows, width = history.shape
    rows, j = jnp.arange(num_rows)[:, None], jnp.arange(width)[None]  # [S, 1], [1, N]
    last = lengths[:, None] - 1  # [S, 1]
    token_at = lambda i: history[rows, jnp.clip(i, 0, width - 1)]  # i [S, *] -> [S, *]
    # Ends j (j < L - 1, so that a token follows) of the occurrences of the last n tokens; each
    # n keeps the ends whose token n - 1 back matches too, while n <= L - 1.
    ends = (j < last) & (history == token_at(last))  # [S, N], n = 1

    def longer(n, carry):  # a loop, not max_n unrolled stages of [S, N]
        ends, best = carry
        ends = ends & (j >= n - 1) & (token_at(j - (n - 1)) == token_at(last - (n - 1)))
        ends = ends & (n <= last)
        # A longer n-gram that recurs replaces a shorter one.
        longest = (n >= min_n) & jnp.any(ends, axis=1, keepdims=True)
        return ends, jnp.where(longest, ends, best)

    _, best = jax.lax.fori_loop(2, max_n + 1, longer, (ends, ends & (min_n <= 1)))
    found = jnp.any(best, axis=1)  # [S]
    start = jnp.argmax(best, axis=1) + 1  # [S] the earliest occurrence's next token
    counts = jnp.where(found, jnp.clip(lengths - start, 0, num_drafts), 0)
    offsets = jnp.arange(num_drafts)[None]  # [1, k]
    drafts = token_at(start[:, None] + offsets)
    return jnp.where(offsets < counts[:, None], drafts, 0), counts.astype(jnp.int32)
