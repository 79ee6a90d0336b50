"""KV cache groups (vLLM's hybrid KV cache manager): a model that mixes sliding-window and
full-attention layers keeps, for its windowed layers, only the pages their window can still read.

The layers are cut into groups of one kind, each of S = `num_slots` layers (the last group of a
kind padded), and a page of the cache holds S layers: the cache is [S, V, K, P, B, H], and layer l
reads and writes row `layer_slot[l]` of the pages in its group's block table. Every group draws
its pages from the one pool, so a page is the KV of S layers of one group: a request holds a
page a block in its full-attention group, and in each windowed group only the blocks from its
window on (the earlier entries of that group's table are the null page).

Gemma 3 (5 windowed layers to 1 global) has S = L / 6 and 6 groups: a 32k prompt holds the global
layers' 2048 pages and each windowed group's ~W / B, about a sixth of what one table for all
layers holds. A model with one kind of layer is one group of all its layers, as before; a model
whose every layer is windowed (Mistral v0.1, Starcoder2) is one windowed group, which frees the
blocks its widest window passed, but not those of a request with penalties: the sampler's
token history is read through the first group's table, which must then hold every block. With
n-gram drafts in windows of speculative rounds, every request's history is read so (the rounds
look their drafts up on the device), and such a model keeps every block in one group."""

import collections
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    # per group: None (keeps every block) or its window W; the first group's W only where
    # every layer is windowed
    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its row of a page, the cache's leading axis
    num_slots: int  # S: the layers one page holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def describe(self) -> str:
        """For the start-up log: the groups, and the layers a page holds."""
        counts = collections.Counter(self.windows)
        kinds = [
            ("full" if w is None else f"window {w}") + (f" x{n}" if n > 1 else "")
            for w, n in counts.items()
        ]
        plural = "s" if self.num_groups > 1 else ""
        return f"{self.num_groups} KV group{plural} ({', '.join(kinds)}) of {self.num_slots} layers"


def single_group(num_layers: int) -> KVCacheGroups:
    """Every layer in one group that keeps every block: page row l is layer l."""
    layers = tuple(range(num_layers))
    return KVCacheGroups((None,), (0,) * num_layers, layers, num_layers)


def kv_cache_groups(
    layer_windows: tuple[int | None, ...], enable: bool = True, keeps_history: bool = False
) -> KVCacheGroups:
    """The groups of a model whose layer l has sliding window `layer_windows[l]` (None: a
    global layer). Hybrid (the full layers first, then each window's layers in chunks of as
    many) when `enable` and the model mixes global and windowed layers; one group of the widest
    window when `enable` and every layer is windowed, unless `keeps_history` (every request's
    tokens are read through the first group's table: n-gram drafts looked up on the device,
    worker/spec_window.py); else one group that keeps every block."""
    full = [layer for layer, w in enumerate(layer_windows) if w is None]
    if not enable or len(full) == len(layer_windows) or (keeps_history and not full):
        return single_group(len(layer_windows))
    if not full:
        return dataclasses.replace(single_group(len(layer_windows)), windows=(max(layer_windows),))
    num_slots = len(full)
    members = [(None, full)]
    for window in sorted({w for w in layer_windows if w is not None}):
        layers = [layer for layer, w in enumerate(layer_windows) if w == window]
        for chunk in range(math.ceil(len(layers) / num_slots)):
            members.append((window, layers[chunk * num_slots : (chunk + 1) * num_slots]))
    layer_group, layer_slot = [0] * len(layer_windows), [0] * len(layer_windows)
    for group, (_, layers) in enumerate(members):
        for slot, layer in enumerate(layers):
            layer_group[layer], layer_slot[layer] = group, slot
    return KVCacheGroups(
        tuple(w for w, _ in members), tuple(layer_group), tuple(layer_slot), num_slots
    )


def blocks_to_hold(
    groups: KVCacheGroups | None,
    num_tokens: int,
    block_size: int,
    max_step_tokens: int,
    keeps_history: bool = True,
) -> int:
    """The most blocks a request of `num_tokens` holds at once, in all groups, when a step
    computes up to `max_step_tokens` of them: a windowed group holds its window's and the
    step's; the first group every block where `keeps_history` (a request with penalties)."""
    num_blocks = -(-num_tokens // block_size)
    windows = groups.windows if groups else (None,)
    if keeps_history:
        windows = (None, *windows[1:])
    return sum(
        num_blocks
        if window is None
        else min(num_blocks, -(-(window - 1 + max_step_tokens) // block_size) + 1)
        for window in windows
    )


def first_kept_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block a windowed group still needs once `num_computed_tokens` are computed:
    the next query, at that position p, sees p - W < j <= p."""
    return max(0, num_computed_tokens - window + 1) // block_size
