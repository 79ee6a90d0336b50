"""Per-request block tables over the block pool, with automatic prefix caching."""

from jvllm.core.block_hash import NONE_HASH, ExtraKeys, get_hash_fn
from jvllm.core.block_pool import ROOT_CACHE_ID, BlockPool, KVCacheBlock
from jvllm.core.kv_groups import KVCacheGroups, blocks_to_hold, first_kept_block
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

    With hybrid `groups` (core/kv_groups.py), `req_to_blocks` is the first group's tables
    (full attention), and each windowed group has a table of its own, as long, whose blocks
    before its window are the null block: freed as the request's computed tokens pass them. A
    windowed group's full blocks are registered under the first group's block at their index,
    and a prefix hit is as long as every windowed group still holds the blocks its window reads
    before the hit's end.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        groups: KVCacheGroups | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = get_hash_fn(hash_algo)
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The windowed groups' windows, and each request's tables in them (groups 1, 2, ...).
        self.groups = groups
        self.windows: tuple[int, ...] = groups.windows[1:] if groups else ()
        # Every layer windowed (core/kv_groups.py): the first group's window, None otherwise.
        self.first_window: int | None = groups.windows[0] if groups else None
        self.req_to_window_blocks: dict[str, list[list[KVCacheBlock]]] = {}
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
        if self.windows:
            del hit_blocks[self._longest_window_hit(hit_blocks) :]
        return hit_blocks, len(hit_blocks) * self.block_size

    def _longest_window_hit(self, hit_blocks: list[KVCacheBlock]) -> int:
        """The most of the first group's `hit_blocks` after which every windowed group still
        holds, cached, the blocks its window reads."""
        runs = []  # per windowed group: the run of cached blocks ending at each index
        for group in range(1, len(self.windows) + 1):
            run, group_runs = 0, []
            for block in hit_blocks:
                cached = self.block_pool.get_window_block((group, block.cache_id))
                run = run + 1 if cached is not None else 0
                group_runs.append(run)
            runs.append(group_runs)
        for num_hit in range(len(hit_blocks), 0, -1):
            num_tokens = num_hit * self.block_size
            if all(
                group_runs[num_hit - 1]
                >= num_hit - first_kept_block(num_tokens, window, self.block_size)
                for group_runs, window in zip(runs, self.windows)
            ):
                return num_hit
        return 0

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
        new_computed_blocks = hits = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total_tokens = num_computed + num_new_tokens
        num_needed = cdiv(num_total_tokens, self.block_size)
        num_fresh = num_needed - len(blocks) - len(new_computed_blocks)
        if self.first_window is not None and not request.sampling_params.has_penalties:
            self._free_outside(blocks, self.first_window, num_computed)
            new_computed_blocks = self._hits_in_window(hits, self.first_window)
        window_hits, window_tables = [], []
        if self.windows:
            self._free_outside_windows(request.request_id, num_computed)
            window_hits = self._window_hits(new_computed_blocks)
            window_tables = self.req_to_window_blocks.get(
                request.request_id, [[]] * len(self.windows)
            )
        num_window_fresh = [
            max(num_needed - len(table) - len(hits), 0)
            for table, hits in zip(window_tables, window_hits)
        ]
        all_hits = [b for hits in (new_computed_blocks, *window_hits) for b in hits if b.block_id]
        # Hits that sit in the free queue leave it when touched, so they do not count as free.
        num_free_hits = sum(1 for block in all_hits if block.ref_cnt == 0)
        if num_fresh + sum(num_window_fresh) > self.num_free_blocks - num_free_hits:
            return None

        self.block_pool.touch(all_hits)
        fresh_blocks = self.block_pool.get_new_blocks(max(num_fresh, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks is not hits:  # the hit's cache ids: its next blocks' parents
            self._cache_ids[request.request_id] = [block.cache_id for block in hits]
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh_blocks)
        if self.windows:
            tables = self.req_to_window_blocks.setdefault(
                request.request_id, [[] for _ in self.windows]
            )
            for table, hits, num in zip(tables, window_hits, num_window_fresh):
                table.extend(hits)
                table.extend(self.block_pool.get_new_blocks(num))
        if self.enable_prefix_caching:
            # Only tokens that exist can be hashed; the scheduled ones get their KV this step.
            self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return fresh_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks are freed first so that they are evicted
        first: a prefix's head is shared by more requests than its tail."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._cache_ids.pop(request.request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b.block_id)
        for table in self.req_to_window_blocks.pop(request.request_id, []):
            self.block_pool.free_blocks(b for b in reversed(table) if b.block_id)

    def _free_outside_windows(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's windowed-group blocks that no query after its
        `num_computed_tokens` reads."""
        for table, window in zip(self.req_to_window_blocks.get(request_id, []), self.windows):
            self._free_outside(table, window, num_computed_tokens)

    def _free_outside(self, table: list[KVCacheBlock], window: int, num_computed: int) -> None:
        """Free the blocks of `table` before a query at `num_computed` sees: each becomes the
        null block in it."""
        null = self.block_pool.null_block
        end = min(first_kept_block(num_computed, window, self.block_size), len(table))
        # The blocks before the last freed one are null already: walk back to it.
        start = end
        while start > 0 and table[start - 1] is not null:
            start -= 1
        self.block_pool.free_blocks(table[start:end])
        table[start:end] = [null] * (end - start)

    def _hits_in_window(self, hit_blocks: list[KVCacheBlock], window: int) -> list[KVCacheBlock]:
        """A prefix hit's blocks as a group of sliding `window` takes them: the null block
        before the window (an all-windowed model's first group holding every hit block would
        hold more than the never-fits check counted, and a request at the head of the queue
        could wait for blocks forever), then the hit's blocks; `hit_blocks` itself where the
        window reaches the first."""
        num_tokens = len(hit_blocks) * self.block_size
        first = min(first_kept_block(num_tokens, window, self.block_size), len(hit_blocks))
        if not first:
            return hit_blocks
        return [self.block_pool.null_block] * first + hit_blocks[first:]

    def _window_hits(self, hit_blocks: list[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        """Each windowed group's blocks for the first group's prefix hit `hit_blocks` (as
        get_computed_blocks found them): the null block before its window, then its cached
        blocks."""
        hits = []
        for group, window in enumerate(self.windows, 1):
            cached = [
                block
                if not block.block_id
                else self.block_pool.get_window_block((group, block.cache_id))
                for block in self._hits_in_window(hit_blocks, window)
            ]
            if any(block is None for block in cached):
                raise RuntimeError("a windowed group's prefix hit was evicted before allocation")
            hits.append(cached)
        return hits

    def num_blocks_to_hold(
        self, num_tokens: int, max_step_tokens: int, keeps_history: bool = True
    ) -> int:
        """The most blocks a request of `num_tokens` holds at once (kv_groups.blocks_to_hold)."""
        return blocks_to_hold(
            self.groups, num_tokens, self.block_size, max_step_tokens, keeps_history
        )

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """At most the blocks the request takes to grow to `num_tokens`, in every group."""
        num_blocks = len(self.req_to_blocks.get(request.request_id, []))
        return (cdiv(num_tokens, self.block_size) - num_blocks) * (1 + len(self.windows))

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Drop the prefix-cache entries of the blocks past `num_computed_tokens`: they were
        registered at allocation for KV that a failed step never wrote."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        for block in blocks[first:]:
            self.block_pool.uncache(block)
        for table in self.req_to_window_blocks.get(request.request_id, []):
            for block in table[first:]:
                self.block_pool.uncache(block)
        del self._cache_ids.get(request.request_id, [])[first:]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's table in the first group (every group but the windowed ones)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_window_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's table in each windowed group (0: the null block); [] without them."""
        tables = self.req_to_window_blocks.get(request_id, [])
        return [[block.block_id for block in table] for table in tables]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; returns False (doing nothing) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        cache_ids = self._cache_ids.setdefault(request.request_id, [])
        tables = self.req_to_window_blocks.get(request.request_id, [])
        for i in range(len(cache_ids), num_tokens // self.block_size):
            if not blocks[i].block_id:  # freed past its window before it was full: no more
                break
            cache_ids.append(
                self.block_pool.cache_full_block(
                    blocks[i],
                    request.block_hashes[i],
                    cache_ids[-1] if cache_ids else ROOT_CACHE_ID,
                    self._block_token_ids(request, i),
                    self._extra_keys(request, i),
                )
            )
            for group, table in enumerate(tables, 1):
                if table[i].block_id:  # not freed already (a step past its window)
                    self.block_pool.cache_window_block(table[i], (group, cache_ids[i]))

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
