"""Per-step attention inputs: one registered dataclass that travels into the jitted step."""

import dataclasses

import jax
import numpy as np

# Tokens per block of a step's own tokens (see window.py): in a step with prefills each query
# attends to the step's tokens in its own block and the one before directly, and reads only
# older positions from the pages. The host needs it to know which queries read pages at all.
WINDOW_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each of them attends to.

    Built on the host (NumPy), padded to a bucket; see docs/design.md for the glossary.
    The `tile_*` fields lay out the queries that read pages as [NT, Q] tiles, each holding
    queries of one sequence only: the reference backend attends a whole tile to a page at a time.
    """

    slot_mapping: jax.Array  # i32[T] flat KV slot (page * B + offset); pad 0 = null page
    block_tables: jax.Array  # i32[S, M] pages of each sequence; pad 0
    seq_lens: jax.Array  # i32[S] KV length after this step; pad 0
    query_start_loc: jax.Array  # i32[S+1] cumulative query lengths
    logits_indices: jax.Array  # i32[S] flat index of each sequence's last scheduled token
    tile_token_idx: jax.Array  # i32[NT, Q] flat token index of each tile slot; pad 0
    tile_kv_lens: jax.Array  # i32[NT, Q] leading positions each query reads from pages; pad 0
    tile_seq: jax.Array  # i32[NT] sequence of each tile; pad 0


def paged_kv_lens(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_seqs: int, tile_q: int):
    """How many leading positions of its sequence each real token reads from the pages -> i32[t].

    Decode steps (tile_q 1) read everything from the pages, their own new key included. In other
    steps a token reads the step's tokens of its window (its WINDOW_BLOCK-aligned block and the
    one before) directly, so only the positions before the first of them come from the pages.
    """
    num_real = int(query_start_loc[num_seqs])
    t = np.arange(num_real)
    seq = np.searchsorted(query_start_loc[1 : num_seqs + 1], t, side="right")
    position = seq_lens[seq] - (query_start_loc[seq + 1] - t)
    if tile_q == 1:
        return position + 1
    window_first = np.maximum(query_start_loc[seq], (t // WINDOW_BLOCK - 1) * WINDOW_BLOCK)
    return position - (t - window_first)


def build_tiles(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_seqs: int, num_tiles: int, tile_q: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each sequence's queries that read pages into tiles of `tile_q`, packed first, and
    pad to `num_tiles` tiles -> (tile_token_idx, tile_kv_lens, tile_seq)."""
    kv_lens = paged_kv_lens(query_start_loc, seq_lens, num_seqs, tile_q)
    token_idx = np.zeros((num_tiles, tile_q), np.int32)
    tile_kv_lens = np.zeros((num_tiles, tile_q), np.int32)
    tile_seq = np.zeros((num_tiles,), np.int32)
    tile = 0
    offsets = np.arange(tile_q, dtype=np.int32)
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        reads = np.flatnonzero(kv_lens[start:end] > 0)  # a suffix of the sequence's queries
        if reads.size == 0:
            continue
        for t0 in range(start + int(reads[0]), end, tile_q):
            n = min(tile_q, end - t0)
            token_idx[tile, :n] = t0 + offsets[:n]
            tile_kv_lens[tile, :n] = kv_lens[t0 : t0 + n]
            tile_seq[tile] = s
            tile += 1
    return token_idx, tile_kv_lens, tile_seq
