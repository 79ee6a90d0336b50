"""The pool of fixed-size KV blocks (pages): reference counts, an LRU free queue, and the
block-hash map behind automatic prefix caching."""

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jvllm.core.block_hash import BlockHash, ExtraKeys

# The cache id a request's first block has for parent; registered blocks count from 1.
ROOT_CACHE_ID = 0

# What a block's KV depends on: (its parent's cache id, its token ids, its extra keys).
CacheKey = tuple[int, tuple[int, ...], ExtraKeys]
# A windowed group's block (core/kv_groups.py): (its group, the cache id of the first group's
# block at its index).
WindowKey = tuple[int, int]


@dataclass(eq=False)
class KVCacheBlock:
    """One page of the KV cache. While the block holds a full, registered block of tokens (in
    use or free but not yet evicted), `block_hash` is its key in the pool's map, `cache_key`
    what its KV depends on, and `cache_id` a number no other registration ever gets: a child
    names its parent by it, so a parent evicted and re-registered with other tokens is a
    different parent."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | WindowKey | None = None
    cache_key: CacheKey | WindowKey | None = None
    cache_id: int | None = None


class BlockPool:
    """Owns every block. Block 0 is the null block (padding target) and is never handed out.

    Free blocks wait in `_free_queue` in eviction order: new blocks are taken from the front,
    freed blocks join the back, and a free block hit by the prefix cache leaves from the middle
    (an OrderedDict makes all three O(1)).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        # Registered blocks by hash. More than one under a hash when it collides, or when a
        # block outlived its parent and the same tokens were registered again after a new one.
        self._cached_blocks: dict[BlockHash, list[KVCacheBlock]] = {}
        self._num_registrations = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.num_free_blocks) / num_usable

    def get_cached_block(
        self,
        block_hash: BlockHash,
        parent_id: int,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys,
    ) -> KVCacheBlock | None:
        """The registered block with these tokens and extra keys after the block whose cache id
        is `parent_id` (ROOT_CACHE_ID for a first block): its KV is the one this block needs.
        The hash only narrows the search; the comparison makes a hit exact."""
        return self._find(block_hash, (parent_id, tuple(token_ids), extra_keys))

    def cache_full_block(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        parent_id: int,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys,
    ) -> int:
        """Register a full block computed after the block with cache id `parent_id` and return
        the cache id its children name as parent. A block already registered (a prefix hit)
        keeps its own; if another block holds the same KV (two requests computed it in
        parallel), this one stays unregistered, is freed later, and stands for that one."""
        if block.cache_id is not None:
            return block.cache_id
        key = (parent_id, tuple(token_ids), extra_keys)
        same = self._find(block_hash, key)
        if same is not None:
            return same.cache_id
        self._num_registrations += 1
        block.block_hash, block.cache_key, block.cache_id = block_hash, key, self._num_registrations
        self._cached_blocks.setdefault(block_hash, []).append(block)
        return block.cache_id

    def cache_window_block(self, block: KVCacheBlock, key: WindowKey) -> None:
        """Register a windowed group's block under `key` (its group, and the cache id of the
        first group's block at the same index: that id names the prefix exactly, the block's
        own parent may be gone). A block already registered, or another with the same key,
        leaves it as it is."""
        if block.block_hash is None and self._find(key, key) is None:
            block.block_hash = block.cache_key = key
            self._cached_blocks.setdefault(key, []).append(block)

    def get_window_block(self, key: WindowKey) -> KVCacheBlock | None:
        """The windowed group's block registered under `key`, if not evicted since."""
        return self._find(key, key)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the back of the free queue in the
        given order (first given = first evicted), keeping their hash until evicted."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible while no request holds blocks."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for blocks in self._cached_blocks.values():
            for block in blocks:
                block.block_hash = block.cache_key = block.cache_id = None
        self._cached_blocks.clear()
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its KV was never written (the step computing it failed)."""
        self._evict(block)

    def _find(self, block_hash: BlockHash, key: CacheKey) -> KVCacheBlock | None:
        for block in self._cached_blocks.get(block_hash, ()):
            if block.cache_key == key:
                return block
        return None

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same_hash = self._cached_blocks[block.block_hash]
        same_hash.remove(block)
        if not same_hash:
            del self._cached_blocks[block.block_hash]
        block.block_hash = block.cache_key = block.cache_id = None
