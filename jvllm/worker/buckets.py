"""The fixed set of padded shapes the jitted step is compiled for."""

import dataclasses

from jvllm.core.decode_window import window_capacity

_MIN_TOKENS = 16
# With speculative decoding, mixed buckets from 2 tokens: a few requests' last tokens and
# drafts (k + 1 tokens each) then run in as few rows as a decode step, which on CPU costs about
# what one row does (up to 8 rows, quantization/cpu_dense.py), where 16 rows cost far more.
SPECULATIVE_MIN_TOKENS = 2
_MIN_SEQS = 8
# Queries per attention tile in mixed steps; decode-only steps use tiles of one query.
MIXED_TILE_Q = 16


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int  # T
    num_seqs: int  # S
    tile_q: int  # Q

    @property
    def tile_groups(self) -> tuple[tuple[int, int], ...]:
        """(tile_q, num_tiles) of each group of attention tiles (see build_tiles): a decode
        bucket has T one-query tiles; a mixed bucket S one-query tiles for its decodes and
        enough Q-query tiles for any split of T tokens among S sequences."""
        if self.tile_q == 1:
            return ((1, self.num_tokens),)
        return ((1, self.num_seqs), (self.tile_q, self.num_tokens // self.tile_q + self.num_seqs))

    @property
    def is_decode(self) -> bool:
        """One token a sequence (a window of speculative rounds' bucket, one-query tiles of
        k + 1 tokens a sequence, is not)."""
        return self.tile_q == 1 and self.num_tokens == self.num_seqs


def _powers_of_two(lo: int, hi: int) -> list[int]:
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    return sizes + [hi]


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    max_num_batched_tokens: int
    max_num_seqs: int
    min_mixed_tokens: int = _MIN_TOKENS  # the smallest mixed bucket's T

    def token_sizes(self) -> list[int]:
        return _powers_of_two(
            min(self.min_mixed_tokens, self.max_num_batched_tokens), self.max_num_batched_tokens
        )

    def seq_sizes(self) -> list[int]:
        hi = min(self.max_num_seqs, self.max_num_batched_tokens)
        sizes = _powers_of_two(min(_MIN_SEQS, hi), hi)
        # A lone decoding sequence gets its own 1-row bucket: a 1-row matmul streams the
        # weights once, where 8 rows take twice as long (SmolLM2 float32: 23 against 44 ms).
        return [1] + sizes if sizes[0] > 1 else sizes

    def all_buckets(self) -> list[Bucket]:
        decode = [Bucket(s, s, 1) for s in self.seq_sizes()]
        mixed = [self._mixed(t) for t in self.token_sizes()]
        return decode + mixed

    def _mixed(self, num_tokens: int) -> Bucket:
        return Bucket(num_tokens, min(num_tokens, self.max_num_seqs), MIXED_TILE_Q)

    def fitting(self, num_tokens: int, num_seqs: int, decode_only: bool = False) -> list[Bucket]:
        """Every bucket that holds a step of `num_tokens` over `num_seqs` sequences, cheapest
        first. A decode-only step (one token a sequence) fits a mixed bucket too."""
        decode_step = num_tokens == num_seqs
        fits = [
            b
            for b in self.all_buckets()
            if b.num_tokens >= num_tokens
            and b.num_seqs >= num_seqs
            and (decode_step or not b.is_decode)
            and (b.is_decode or not decode_only)
        ]
        return sorted(fits, key=lambda b: (b.num_tokens, b.tile_q))

    def select(self, num_tokens: int, num_seqs: int) -> Bucket:
        """The smallest bucket that holds a step of `num_tokens` over `num_seqs` sequences."""
        if num_tokens == num_seqs:  # every sequence decodes one token
            size = next(s for s in self.seq_sizes() if s >= num_seqs)
            return Bucket(size, size, 1)
        return self._mixed(next(t for t in self.token_sizes() if t >= num_tokens))

    def window_shape(self, num_seqs: int, num_drafts: int) -> tuple[Bucket, str]:
        """(bucket, kind) of a decode window of `num_seqs` sequences: a decode bucket's
        "window", or with speculation (k = `num_drafts`) a "spec_window" of the decode
        bucket's rows with k + 1 tokens each (worker/spec_window.py)."""
        bucket = self.select(num_seqs, num_seqs)
        if not num_drafts:
            return bucket, "window"
        return Bucket(bucket.num_seqs * (num_drafts + 1), bucket.num_seqs, 1), "spec_window"

    def window_shapes(self, num_drafts: int) -> list[tuple[Bucket, str]]:
        """The window shapes a scheduler can run, by decode bucket (ascending): a window of
        n requests takes n (k + 1) tokens, at most max_num_batched_tokens
        (core/decode_window.py), so a bucket whose fewest requests (one more than the bucket
        below holds) take more never runs one (with speculation; without, every decode
        bucket fits the budget)."""
        sizes = self.seq_sizes()
        fewest = [1] + [n + 1 for n in sizes[:-1]]
        return [
            self.window_shape(n, num_drafts)
            for n, least in zip(sizes, fewest, strict=True)
            if self.runs_window(least, num_drafts)
        ]

    def runs_window(self, num_seqs: int, num_drafts: int) -> bool:
        """Whether the scheduler runs a window of `num_seqs` requests (their rounds'
        n (k + 1) tokens fit max_num_batched_tokens)."""
        return num_seqs <= window_capacity(self.max_num_batched_tokens, num_drafts)
