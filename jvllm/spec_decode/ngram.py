"""n-gram (prompt lookup) drafts: NumPy over one request's tokens, run for every decoding
request every step, so it touches each token at most `max_n` times."""

import numpy as np


def propose_ngram_drafts(
    token_ids: np.ndarray, min_n: int, max_n: int, num_drafts: int
) -> list[int]:
    """The tokens that followed the longest n-gram (min_n <= n <= max_n) ending the sequence,
    at its earliest earlier occurrence; up to `num_drafts` of them, [] when no n-gram recurs.

    `token_ids` i32[L]: the request's prompt and output tokens."""
    length = len(token_ids)
    if num_drafts < 1 or length < min_n + 1:
        return []
    # Ends j (j < L - 1, so that a token follows) of the occurrences matching the last n tokens,
    # for n = 1, 2, ...: each n keeps the ends whose token n positions back matches too.
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    best = ends if min_n <= 1 else np.empty(0, np.intp)
    for n in range(2, min(max_n, length - 1) + 1):
        ends = ends[ends >= n - 1]
        ends = ends[token_ids[ends - (n - 1)] == token_ids[length - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends
    if not len(best):
        return []
    start = int(best[0]) + 1
    return token_ids[start : start + num_drafts].tolist()
