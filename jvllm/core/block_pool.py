"""The pool of fixed-size KV blocks (pages): reference counts, an LRU free queue, and the
block-hash map behind automatic prefix caching."""

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Parent hash of a request's first block. Python hashes ints and tuples of ints the same way in
# every process, so block hashes are reproducible.
_ROOT_HASH = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chain hash of one full block: it depends on every token before the block too."""
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


@dataclass(eq=False)
class KVCacheBlock:
    """One page of the KV cache. `block_hash` is set while the block holds a full, registered
    block of tokens (in use or free but not yet evicted); `token_ids` guards hash collisions."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns every block. Block 0 is the null block (padding target) and is never handed out.

    Free blocks wait in `_free_queue` in eviction order: new blocks are taken from the front,
    freed blocks join the back, and a free block hit by the prefix cache leaves from the middle
    (an OrderedDict makes all three O(1)).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self._cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self.num_free_blocks) / num_usable

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVCacheBlock | None:
        block = self._cached_blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: int, token_ids: Sequence[int]
    ) -> None:
        """Register a full block. If another block already holds the same tokens (two requests
        computed it in parallel), this one stays unregistered and is simply freed later."""
        if not self.enable_caching or block_hash in self._cached_blocks:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached_blocks[block_hash] = block

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
        for block in self._cached_blocks.values():
            block.block_hash = None
            block.token_ids = None
        self._cached_blocks.clear()
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: its KV was never written (the step computing it failed)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self._cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = None
