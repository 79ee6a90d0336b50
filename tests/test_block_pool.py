"""Block pool and KV cache manager: ref counts, LRU eviction, prefix caching."""

from jvllm.core.block_hash import NONE_HASH, sha256
from jvllm.core.block_pool import ROOT_CACHE_ID, BlockPool
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request
from jvllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, prompt_token_ids, SamplingParams(), eos_token_id=None)


def allocate_prompt(kv: KVCacheManager, request: Request):
    """Schedule a whole prompt as the scheduler does: prefix lookup, allocate, and on admission
    count the lookup."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit)
    if new_blocks is not None:
        kv.record_prefix_lookup(request, num_hit)
        request.num_computed_tokens = num_hit
    return new_blocks, num_hit


def test_null_block_is_never_handed_out():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(16)))
    assert kv.allocate_slots(request, 16) is not None
    assert sorted(kv.get_block_ids("a")) == [1, 2, 3, 4]
    assert kv.num_free_blocks == 0
    assert kv.usage == 1.0


def test_allocation_covers_tokens_and_free_releases_refs():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(6)))
    new_blocks = kv.allocate_slots(request, 6)
    assert [b.block_id for b in new_blocks] == [1, 2]
    assert all(b.ref_cnt == 1 for b in new_blocks)
    request.num_computed_tokens = 6
    # Two more tokens still fit block 2; the ninth needs a third block.
    assert kv.allocate_slots(request, 2) == []
    assert [b.block_id for b in kv.allocate_slots(request, 3)] == [3]
    assert kv.get_block_ids("a") == [1, 2, 3]
    kv.free(request)
    assert kv.num_free_blocks == 9
    assert all(b.ref_cnt == 0 for b in new_blocks)
    assert kv.get_block_ids("a") == []


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    shared = list(range(8))
    first = make_request("a", shared + [100])
    allocate_prompt(kv, first)
    kv.free(first)
    # 17 tokens: 2 hit blocks + 3 fresh ones, but the 4 free blocks include the 2 hits.
    second = make_request("b", shared + list(range(200, 209)))
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    assert kv.allocate_slots(second, second.num_tokens - num_hit, hit_blocks, num_hit) is None
    assert kv.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in hit_blocks)
    assert kv.get_block_ids("b") == []
    assert kv.get_computed_blocks(make_request("c", shared + [1]))[1] == 8


def test_freed_tail_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=7, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(12)))
    allocate_prompt(kv, first)
    assert kv.get_block_ids("a") == [1, 2, 3]
    kv.free(first)
    # Free queue: never-used 4, 5, 6, then a's blocks tail first: 3, 2, 1.
    other = make_request("b", list(range(100, 124)))
    allocate_prompt(kv, other)
    assert kv.get_block_ids("b") == [4, 5, 6, 3, 2, 1]


def test_prefix_hit_reuses_full_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    allocate_prompt(kv, first)
    second = make_request("b", list(range(8)) + [50, 51, 52])
    new_blocks, num_hit = allocate_prompt(kv, second)
    assert num_hit == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] not in kv.get_block_ids("a")
    assert [b.ref_cnt for b in kv.req_to_blocks["b"]] == [2, 2, 1]
    assert len(new_blocks) == 1


def test_prefix_hit_never_covers_the_last_prompt_token():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    allocate_prompt(kv, make_request("a", prompt))
    # The same 2-block prompt can reuse only its first block: the last token must be computed.
    _, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 4


def test_hit_statistics_count_tokens():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    allocate_prompt(kv, make_request("a", list(range(9))))
    allocate_prompt(kv, make_request("b", list(range(9))))
    assert kv.prefix_cache_queries == 18
    assert kv.prefix_cache_hits == 8
    assert kv.prefix_cache_hit_rate == 8 / 18


def test_freed_blocks_stay_cached_until_evicted():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    first = make_request("a", prompt)
    allocate_prompt(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(make_request("b", prompt))[1] == 8
    # Using every block evicts the cached ones.
    filler = make_request("c", list(range(100, 116)))
    allocate_prompt(kv, filler)
    kv.free(filler)
    assert kv.get_computed_blocks(make_request("d", prompt))[1] == 0


def test_only_known_tokens_are_registered():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(6)))
    # Slots for 8 tokens, but only 6 exist: block 2 is not full of known tokens yet.
    kv.allocate_slots(request, 8)
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]


def test_decode_tokens_complete_and_register_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    allocate_prompt(kv, request)
    request.num_computed_tokens = 3
    request.append_output_token_ids(4)
    kv.allocate_slots(request, 1)
    assert kv.req_to_blocks["a"][0].block_hash == sha256(NONE_HASH, [1, 2, 3, 4], ())
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[1] == 4


def test_hash_collision_with_different_tokens_is_a_miss():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h", ROOT_CACHE_ID, [1, 2], ())
    assert pool.get_cached_block(b"h", ROOT_CACHE_ID, [1, 2], ()) is block
    assert pool.get_cached_block(b"h", ROOT_CACHE_ID, [1, 3], ()) is None


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    allocate_prompt(kv, make_request("a", list(range(9))))
    assert allocate_prompt(kv, make_request("b", list(range(9))))[1] == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(9)))
    allocate_prompt(kv, request)
    assert not kv.reset_prefix_cache()
    kv.free(request)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
