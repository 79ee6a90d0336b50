"""Per-step attention inputs: one registered dataclass that travels into the jitted step."""

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each of them attends to.

    Built on the host (NumPy), padded to a bucket; see docs/design.md for the glossary.
    The `tile_*` fields lay the flat queries out as [NT, Q] tiles, each holding queries of one
    sequence only: the reference backend attends a whole tile to a page at a time.
    """

    slot_mapping: jax.Array  # i32[T] flat KV slot (page * B + offset); pad 0 = null page
    block_tables: jax.Array  # i32[S, M] pages of each sequence; pad 0
    seq_lens: jax.Array  # i32[S] KV length after this step; pad 0
    query_start_loc: jax.Array  # i32[S+1] cumulative query lengths
    logits_indices: jax.Array  # i32[S] flat index of each sequence's last scheduled token
    tile_token_idx: jax.Array  # i32[NT, Q] flat token index of each tile slot; pad 0
    tile_positions: jax.Array  # i32[NT, Q] absolute position of each query; pad -1 (sees nothing)
    tile_seq: jax.Array  # i32[NT] sequence of each tile; pad 0


def build_tiles(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_seqs: int, num_tiles: int, tile_q: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split each sequence's queries into tiles of `tile_q` and pad to `num_tiles` tiles."""
    token_idx = np.zeros((num_tiles, tile_q), np.int32)
    positions = np.full((num_tiles, tile_q), -1, np.int32)
    tile_seq = np.zeros((num_tiles,), np.int32)
    tile = 0
    offsets = np.arange(tile_q, dtype=np.int32)
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        first_pos = int(seq_lens[s]) - (end - start)  # the queries are the last q_len positions
        for t0 in range(start, end, tile_q):
            n = min(tile_q, end - t0)
            token_idx[tile, :n] = t0 + offsets[:n]
            positions[tile, :n] = first_pos + (t0 - start) + offsets[:n]
            tile_seq[tile] = s
            tile += 1
    return token_idx, positions, tile_seq
