"""Per-request block tables over the block pool, with automatic prefix caching."""

from jvllm.core.block_hash import NONE_HASH, ExtraKeys, get_hash_fn
from jvllm.core.block_pool import ROOT_CACHE_ID, BlockPool, KVCacheBlock
from jvllm.core.multimodal import overlapping
from jvllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to an append-only list of blocks; token at position p lives in block
    `table[p // block_size]`, offset `p % block_size`.

    With prefix caching, every full block is registered under a chain hash of its tokens
    (`hash_algo`, block_hash.py), so a later request with the same prefix, and the same
    `cache_salt`, reuses the blocks instead of recomputing them.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = get_hash_fn(hash_algo)
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # For each leading block of a table already registered, the cache id that its next
        # block names as parent (block_pool.py: its own, or that of a block with the same KV).
        self._cache_ids: dict[str, list[int]] = {}
        # Hit statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request could ever hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks and its length in tokens.

        The hit never covers the last token: it must be computed to get the logits to sample from.
        The blocks are not referenced yet; pass them to `allocate_slots` in the same step, and
        `record_prefix_lookup` once the request is admitted (a head of the queue that waits for
        blocks is looked up again every step and must not count each time).
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.block_pool.get_cached_block(
                block_hash,
                hit_blocks[-1].cache_id if hit_blocks else ROOT_CACHE_ID,
                self._block_token_ids(request, i),
                self._extra_keys(request, i),
            )
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks, len(hit_blocks) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup in the hit counters."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to cover `num_computed_tokens + num_new_computed_tokens +
        num_new_tokens` tokens, first with the prefix-cache hits, then with fresh blocks.

        Returns the fresh blocks (possibly an empty list), or None, changing nothing, when the
        free queue is too short. Test the result with `is None`.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_fresh = cdiv(num_total_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue leave it when touched, so they do not count as free.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_fresh > self.num_free_blocks - num_free_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        fresh_blocks = self.block_pool.get_new_blocks(max(num_fresh, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh_blocks)
        if self.enable_prefix_caching:
            # Only tokens that exist can be hashed; the scheduled ones get their KV this step.
            self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return fresh_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks are freed first so that they are evicted
        first: a prefix's head is shared by more requests than its tail."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._cache_ids.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Drop the prefix-cache entries of the blocks past `num_computed_tokens`: they were
        registered at allocation for KV that a failed step never wrote."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        for block in blocks[first:]:
            self.block_pool.uncache(block)
        del self._cache_ids.get(request.request_id, [])[first:]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; returns False (doing nothing) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        cache_ids = self._cache_ids.setdefault(request.request_id, [])
        for i in range(len(cache_ids), num_tokens // self.block_size):
            cache_ids.append(
                self.block_pool.cache_full_block(
                    blocks[i],
                    request.block_hashes[i],
                    cache_ids[-1] if cache_ids else ROOT_CACHE_ID,
                    self._block_token_ids(request, i),
                    self._extra_keys(request, i),
                )
            )

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain of full-block hashes to cover all its current tokens."""
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // self.block_size):
            parent = hashes[i - 1] if i > 0 else NONE_HASH
            hashes.append(
                self._hash_fn(
                    parent, self._block_token_ids(request, i), self._extra_keys(request, i)
                )
            )

    def _extra_keys(self, request: Request, block_index: int) -> ExtraKeys:
        """What a block's KV depends on beyond its tokens: the salt and the LoRA adapter, on
        the first block (the chain carries them to the others), and the content hash of each
        image with tokens in the block: an image's placeholder ids are the same whatever the
        image, so without it two prompts with different images would share KV."""
        images = ()
        if request.mm_features:
            start = block_index * self.block_size
            images = tuple(
                request.mm_features[i].identifier
                for i in overlapping(request.mm_features, start, start + self.block_size)
            )
        if block_index > 0:  # a first block's parent is NONE_HASH, never a later one's
            return images
        salt = request.cache_salt
        lora = f"lora:{request.lora_request.lora_int_id}" if request.lora_request else None
        if images:  # three keys or more: no salt and adapter alone hash the same
            return (salt or "", lora or "", *images)
        if lora is not None:  # two keys: no salt alone hashes the same
            return (salt or "", lora)
        return () if salt is None else (salt,)

    def _block_token_ids(self, request: Request, block_index: int) -> list[int]:
        start = block_index * self.block_size
        return request.all_token_ids[start : start + self.block_size]
