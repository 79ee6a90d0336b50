"""The prefix cache cannot be poisoned: a hit needs the same tokens, the same chain before them
and the same cache_salt, whatever the hash function; hashes are stable; the option is checked.
Mostly on the host-side core; the engine tests use the tiny random Llama."""

import hashlib
import os
import struct
import subprocess
import sys

import httpx
import pytest

from jvllm import LLM, EngineArgs, SamplingParams
from jvllm.core import block_hash
from jvllm.core.block_hash import NONE_HASH, PREFIX_CACHING_HASH_ALGOS
from jvllm.core.block_pool import ROOT_CACHE_ID, BlockPool
from jvllm.core.config import SchedulerConfig
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler
from jvllm.engine.async_llm import AsyncLLM
from jvllm.engine.input_processor import prompt_cache_salt
from jvllm.entrypoints import cli
from jvllm.entrypoints.engine_flags import engine_kwargs
from jvllm.entrypoints.openai.api_server import build_app
from jvllm.entrypoints.openai.server_thread import ServerThread

BLOCK_SIZE = 4
PREFIX = [1, 2, 3, 4]
OTHER_PREFIX = [91, 92, 93, 94]
SHARED_BLOCK = [5, 6, 7, 8]


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, prompt, SamplingParams(), eos_token_id=None, cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Look the prompt up and allocate it as the scheduler does; the number of hit tokens."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit) is not None
    request.num_computed_tokens = num_hit
    return num_hit


@pytest.fixture
def colliding_hash(monkeypatch):
    """Make "sha256" a hash under which every block of every prompt collides."""
    monkeypatch.setitem(block_hash._HASH_FNS, "sha256", lambda parent, tokens, extra: b"same")


# ---- the guard: a hit is exact, even when every hash collides ----


def test_equal_block_after_a_different_prefix_never_reuses_its_kv(colliding_hash):
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_request("a", PREFIX + SHARED_BLOCK + [9])
    admit(kv, first)
    # The same second block after another first block: nothing to reuse.
    assert admit(kv, make_request("b", OTHER_PREFIX + SHARED_BLOCK + [9])) == 0
    # The shared block alone as a first block is not the one computed after PREFIX either.
    assert admit(kv, make_request("c", SHARED_BLOCK + [9])) == 0
    # The exact prefixes still hit, each its own blocks, though all share one hash.
    same = make_request("d", PREFIX + SHARED_BLOCK + [9])
    assert admit(kv, same) == 8
    assert kv.get_block_ids("d")[:2] == kv.get_block_ids("a")[:2]
    other = make_request("e", OTHER_PREFIX + SHARED_BLOCK + [9])
    assert admit(kv, other) == 8
    assert kv.get_block_ids("e")[:2] == kv.get_block_ids("b")[:2]


def test_child_of_an_evicted_parent_is_not_the_child_of_its_replacement():
    pool = BlockPool(num_blocks=4)
    parent, child = pool.get_new_blocks(2)
    parent_id = pool.cache_full_block(parent, b"h", ROOT_CACHE_ID, PREFIX, ())
    pool.cache_full_block(child, b"h", parent_id, SHARED_BLOCK, ())
    assert pool.get_cached_block(b"h", parent_id, SHARED_BLOCK, ()) is child
    # The parent's page is taken for other tokens that hash the same; the child stays cached.
    pool.uncache(parent)
    new_parent_id = pool.cache_full_block(parent, b"h", ROOT_CACHE_ID, OTHER_PREFIX, ())
    assert new_parent_id != parent_id
    assert pool.get_cached_block(b"h", new_parent_id, SHARED_BLOCK, ()) is None


def test_recomputed_prefix_after_its_parent_was_evicted_is_cached_again():
    # A first block evicted while its child stays: the prefix, computed again, is reusable again.
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    request = make_request("a", PREFIX + SHARED_BLOCK + [9])
    admit(kv, request)
    kv.free(request)
    kv.block_pool.uncache(kv.block_pool.blocks[1])  # the first block
    assert admit(kv, make_request("b", PREFIX + SHARED_BLOCK + [9])) == 0
    assert admit(kv, make_request("c", PREFIX + SHARED_BLOCK + [9])) == 8


# ---- cache_salt ----


@pytest.mark.parametrize("weak", [False, True], ids=["sha256", "colliding"])
def test_cache_salt_hits_only_blocks_of_the_same_salt(weak, monkeypatch):
    if weak:
        monkeypatch.setitem(block_hash._HASH_FNS, "sha256", lambda parent, tokens, extra: b"x")
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE)
    prompt = PREFIX + SHARED_BLOCK + [9]
    assert admit(kv, make_request("plain", prompt)) == 0
    assert admit(kv, make_request("salted", prompt, cache_salt="alice")) == 0
    assert admit(kv, make_request("other salt", prompt, cache_salt="bob")) == 0
    assert admit(kv, make_request("same salt", prompt, cache_salt="alice")) == 8
    assert kv.get_block_ids("same salt")[:2] == kv.get_block_ids("salted")[:2]
    assert admit(kv, make_request("plain again", prompt)) == 8
    assert kv.get_block_ids("plain again")[:2] == kv.get_block_ids("plain")[:2]


def test_salted_request_reports_no_cached_tokens_against_unsalted_blocks():
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), kv)
    prompt = PREFIX + SHARED_BLOCK + [9]
    requests = [
        make_request("plain", prompt),
        make_request("salted", prompt, cache_salt="alice"),
        make_request("same salt", prompt, cache_salt="alice"),
    ]
    for request in requests:  # one at a time: each sees the blocks of those before
        scheduler.add_request(request)
        output = scheduler.schedule()
        scheduler.update_from_output(output, {r.request_id: 0 for r in output.scheduled_requests})
    assert [r.num_cached_tokens for r in requests] == [0, 0, 8]


def test_cache_salt_must_be_a_non_empty_str():
    assert prompt_cache_salt({"prompt": "hi", "cache_salt": "s"}) == "s"
    assert prompt_cache_salt({"prompt": "hi", "cache_salt": None}) is None
    assert prompt_cache_salt("hi") is None
    for bad in ("", 3):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty str"):
            prompt_cache_salt({"prompt": "hi", "cache_salt": bad})


# ---- the option ----


def test_bad_hash_algo_is_a_value_error_naming_the_field_and_choices():
    message = r"prefix_caching_hash_algo must be one of \('sha256', 'sha256_cbor', 'builtin'\)"
    with pytest.raises(ValueError, match=message + ", got 'xxhash'"):
        EngineArgs(prefix_caching_hash_algo="xxhash")
    with pytest.raises(ValueError, match=message):
        KVCacheManager(num_blocks=4, hash_algo="md5")


def test_serve_flag_sets_the_hash_algo():
    args = cli.build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "builtin"])
    assert engine_kwargs(args)["prefix_caching_hash_algo"] == "builtin"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "md5"])


# ---- stable hashes ----


def test_sha256_block_hash_is_the_documented_bytes():
    expected = hashlib.sha256(
        NONE_HASH + struct.pack("<Q3q", 3, 7, 300, 70000) + struct.pack("<Q", 5) + b"alice"
    ).digest()
    assert block_hash.sha256(NONE_HASH, [7, 300, 70000], ("alice",)) == expected


@pytest.mark.parametrize(
    "value, encoded",
    [  # RFC 8949, Appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (-1000, "3903e7"),
        (None, "f6"),
        (b"\x01\x02\x03\x04", "4401020304"),
        ("IETF", "6449455446"),
        ((1, (2, 3), (4, 5)), "8301820203820405"),
        (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ],
)
def test_cbor_encoding_is_rfc_8949s(value, encoded):
    assert block_hash._cbor(value).hex() == encoded


def test_sha256_cbor_hashes_the_canonical_cbor_of_parent_tokens_and_extra_keys():
    token_ids = [0, 23, 24, 255, 256, 65535, 65536, 2**32]  # every width
    for extra_keys in ((), ("alice",)):
        data = block_hash._cbor((NONE_HASH, tuple(token_ids), extra_keys or None))
        expected = hashlib.sha256(data).digest()
        assert block_hash.sha256_cbor(NONE_HASH, token_ids, extra_keys) == expected


# block_hash.py alone (it imports only the standard library), not the package, which starts JAX.
_HASH_IN_SUBPROCESS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("block_hash", sys.argv[1])
block_hash = importlib.util.module_from_spec(spec)
spec.loader.exec_module(block_hash)
for algo in ("sha256", "sha256_cbor"):
    print(block_hash.get_hash_fn(algo)(block_hash.NONE_HASH, [5, 900, 77, 12000], ("alice",)).hex())
"""


def test_sha256_hashes_do_not_depend_on_pythonhashseed():
    expected = [
        block_hash.get_hash_fn(algo)(NONE_HASH, [5, 900, 77, 12000], ("alice",)).hex()
        for algo in ("sha256", "sha256_cbor")
    ]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _HASH_IN_SUBPROCESS, block_hash.__file__],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    for run in runs:
        assert run.communicate(timeout=60)[0].split() == expected


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_each_algo_gives_the_same_chain_twice_and_a_new_one_for_a_new_salt(algo):
    def chain(cache_salt=None) -> list[bytes]:
        kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, hash_algo=algo)
        request = make_request("a", PREFIX + SHARED_BLOCK + [9], cache_salt)
        kv.get_computed_blocks(request)
        return request.block_hashes

    first = chain()
    assert len(first) == 2 and first == chain()
    assert chain("alice") == chain("alice")
    assert not set(chain("alice")) & set(first)


# ---- the engine ----

ENGINE_KWARGS = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "max_model_len": 128,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 4,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = [(i * 7919) % 40000 + 100 for i in range(21)]  # a shared prefix of 5 blocks and a token
PROMPTS = [SYSTEM + [17, 900 + i, 33] for i in range(3)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **ENGINE_KWARGS)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_with_the_prefix_cache_equal_those_without(llm, tiny_llama_dir):
    # One prompt first, so that the others find its prefix cached.
    cached = _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    later = llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 20 for o in later)
    cached += _tokens(later)
    uncached_llm = LLM(tiny_llama_dir, enable_prefix_caching=False, **ENGINE_KWARGS)
    uncached = _tokens(uncached_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert cached == uncached


def test_offline_cache_salt_keeps_prompts_apart(llm):
    prompt = SYSTEM + [5, 6, 7]
    plain = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    salted = {"prompt_token_ids": prompt, "cache_salt": "alice"}
    first = llm.generate([salted], GREEDY, use_tqdm=False)[0]
    again = llm.generate([salted], GREEDY, use_tqdm=False)[0]
    other = llm.generate([{**salted, "cache_salt": "bob"}], GREEDY, use_tqdm=False)[0]
    assert [o.num_cached_tokens for o in (first, again, other)] == [0, 20, 0]
    assert _tokens([first, again, other]) == _tokens([plain]) * 3
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{**salted, "cache_salt": ""}], GREEDY, use_tqdm=False)


def test_http_cache_salt_reaches_the_engine_and_empty_is_400(llm):
    # Last in the module: the engine is the server's from here on.
    engine = AsyncLLM(llm.llm_engine)
    server = ServerThread(build_app(engine, "tiny")).start()
    kv = llm.llm_engine.scheduler.kv_cache_manager
    try:
        prompt = [7000 + i for i in range(23)]  # 5 full blocks before its last token
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            response = httpx.post(server.url + path, json={**request, "cache_salt": ""}, timeout=60)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "cache_salt"
        hits = []
        for salt in (None, None, "alice", "alice", "bob"):
            before = kv.prefix_cache_hits
            response = httpx.post(
                server.url + "/v1/completions", json={**body, "cache_salt": salt}, timeout=60
            )
            assert response.status_code == 200, response.text
            hits.append(kv.prefix_cache_hits - before)
        assert hits == [0, 20, 0, 20, 0]
    finally:
        server.stop()
        engine.shutdown()
