"""Per-step attention inputs: one registered dataclass that travels into the jitted step."""

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tiles:
    """Queries that read pages, grouped into [NT, Q] tiles of one sequence each: the reference
    backend attends a whole tile to a page at a time. Pads: token 0, reads nothing, sequence 0."""

    token_idx: jax.Array  # i32[NT, Q] flat token index of each tile slot
    kv_lens: jax.Array  # i32[NT, Q] leading positions each query reads from pages
    seq: jax.Array  # i32[NT] sequence of each tile


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupTables:
    """Every KV group's block tables and slots, where the model's layers are in hybrid groups
    (core/kv_groups.py): group 0's are the metadata's own; a windowed group's tables hold the
    null page before its window."""

    block_tables: jax.Array  # i32[G, S, M]
    slot_mapping: jax.Array  # i32[G, T]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each of them attends to.

    Built on the host (NumPy), padded to a bucket; see docs/design.md for the glossary.
    `tiles` holds one group of tiles per tile size: a decode step has one group of one-query
    tiles; a step with prefills has one-query tiles for sequences with a single query (decodes)
    and 16-query tiles for the others, so that a decode next to prefills does not pay for 16.
    """

    slot_mapping: jax.Array  # i32[T] flat KV slot (page * B + offset); pad 0 = null page
    block_tables: jax.Array  # i32[S, M] pages of each sequence; pad 0
    seq_lens: jax.Array  # i32[S] KV length after this step; pad 0
    query_start_loc: jax.Array  # i32[S+1] cumulative query lengths
    logits_indices: jax.Array  # i32[S] flat index of each sequence's last scheduled token
    tiles: tuple[Tiles, ...]
    # i32[T] the LoRA adapter slot each token reads (-1: none; layers/lora.py); None: the
    # engine serves no adapters. It rides here because the model's forward takes this object.
    adapter_slots: jax.Array | None = None
    # i32[T] for a model whose image tokens attend to their whole image (Gemma 3): each image
    # token's image, numbered within the step, -1 for every other token; None for any other
    # model (attention/image_ahead.py).
    image_groups: jax.Array | None = None
    # Hybrid KV groups' tables (a layer attends with its group's: `for_group`); None when
    # the layers are one group, whose tables are the ones above.
    kv_groups: GroupTables | None = None

    def for_group(self, group: jax.Array) -> "AttentionMetadata":
        """The metadata of a layer in KV group `group` (i32[], possibly traced)."""
        return dataclasses.replace(
            self,
            block_tables=self.kv_groups.block_tables[group],
            slot_mapping=self.kv_groups.slot_mapping[group],
            kv_groups=None,
        )

    @property
    def is_decode(self) -> bool:
        """Every sequence decodes one token (static: it follows from the shapes): one group of
        one-query tiles, a tile a sequence. A group of one-query tiles with more tiles than
        sequences is a step of several queries a sequence, each its own tile (a window of
        speculative rounds, worker/spec_window.py)."""
        (tiles, *others) = self.tiles
        return not others and tiles.token_idx.shape == (self.seq_lens.shape[0], 1)


def paged_kv_lens(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_seqs: int, is_decode: bool
) -> np.ndarray:
    """How many leading positions of its sequence each real token reads from the pages -> i32[t].

    Decode steps read everything from the pages, their own new key included. In other steps a
    token reads its sequence's tokens of this step directly (window.py), so only the positions
    computed in earlier steps come from the pages.
    """
    num_real = int(query_start_loc[num_seqs])
    t = np.arange(num_real)
    seq = np.searchsorted(query_start_loc[1 : num_seqs + 1], t, side="right")
    position = seq_lens[seq] - (query_start_loc[seq + 1] - t)
    if is_decode:
        return position + 1
    return position - (t - query_start_loc[seq])


def _group_for(num_queries: int, groups: tuple[tuple[int, int], ...]) -> int:
    """The first group of one-query tiles for a lone query, else the first with larger tiles."""
    return next(i for i, (tile_q, _) in enumerate(groups) if tile_q > 1 or num_queries == 1)


def build_tiles(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    num_seqs: int,
    groups: tuple[tuple[int, int], ...],
    max_split_queries: int = 1,
) -> tuple[Tiles, ...]:
    """Tile the queries that read pages into `groups` of (tile_q, num_tiles), packed first
    (longest read first) and padded. A sequence with one query goes to the group of one-query
    tiles when there is one, the others to the first group of larger tiles. A single group of
    tile_q 1 is a decode step.

    A sequence of up to `max_split_queries` queries goes to one-query tiles too, one a query,
    while that group has room: speculative decoding's drafts (a few queries) then read the pages
    through the CPU decode kernel, where a 16-query tile's page walk cost a batch-1 step twice
    a decode step.
    """
    is_decode = groups == ((1, len(query_start_loc) - 1),)
    kv_lens = paged_kv_lens(query_start_loc, seq_lens, num_seqs, is_decode)
    out = tuple(
        Tiles(np.zeros((n, q), np.int32), np.zeros((n, q), np.int32), np.zeros(n, np.int32))
        for q, n in groups
    )
    if is_decode:  # token s is sequence s's only query, and every one reads the pages
        (tiles,) = out
        tiles.token_idx[:num_seqs, 0] = tiles.seq[:num_seqs] = np.arange(num_seqs)
        tiles.kv_lens[:num_seqs, 0] = kv_lens
        _longest_first(tiles, num_seqs)
        return out
    used = [0] * len(groups)
    for s in range(num_seqs):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        reads = np.flatnonzero(kv_lens[start:end] > 0)  # a suffix of the sequence's queries
        if reads.size == 0:
            continue
        # Room for its queries in one-query tiles, and a tile kept for each sequence after it.
        num_needed = end - start - int(reads[0]) + num_seqs - s - 1
        splits = end - start <= max_split_queries and used[0] + num_needed <= groups[0][1]
        g = 0 if groups[0][0] == 1 and splits else _group_for(end - start, groups)
        tiles, tile_q = out[g], groups[g][0]
        for t0 in range(start + int(reads[0]), end, tile_q):
            n, tile = min(tile_q, end - t0), used[g]
            tiles.token_idx[tile, :n] = t0 + np.arange(n, dtype=np.int32)
            tiles.kv_lens[tile, :n] = kv_lens[t0 : t0 + n]
            tiles.seq[tile] = s
            used[g] += 1
    for tiles, num_used in zip(out, used):
        _longest_first(tiles, num_used)
    return out


def _longest_first(tiles: Tiles, num_used: int) -> None:
    """Reorder the used tiles by the longest read among their queries, longest first: the page
    loop walks each block of tiles only as far as that block's longest, so tiles of similar
    lengths belong in the same block (the order of tiles changes nothing else)."""
    order = np.argsort(-tiles.kv_lens[:num_used].max(axis=1), kind="stable")
    for array in (tiles.token_idx, tiles.kv_lens, tiles.seq):
        array[:num_used] = array[order]
