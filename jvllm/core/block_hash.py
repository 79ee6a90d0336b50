"""Chain hashes of full KV blocks, the keys of the prefix cache (vLLM's
`prefix_caching_hash_algo`).

A block's hash covers its parent's hash, its token ids and its extra keys (what else its KV
depends on: the request's `cache_salt` on its first block), so it stands for the whole prefix.
The hash only finds candidates: the block pool also compares a candidate's parent, tokens and
extra keys before reusing its KV (block_pool.py), so a collision costs a comparison, never a
wrong answer, whichever algorithm is chosen.
"""

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes
ExtraKeys = tuple[str, ...]
HashFn = Callable[[BlockHash, Sequence[int], ExtraKeys], BlockHash]

# The parent of a request's first block. Fixed, so that sha256 hashes are the same in every
# process (vLLM draws it at random unless PYTHONHASHSEED is set).
NONE_HASH = bytes(32)


@functools.cache
def _tokens_struct(num_tokens: int) -> struct.Struct:
    """Little-endian u64 count, then the ids as little-endian i64."""
    return struct.Struct(f"<Q{num_tokens}q")


def sha256(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys) -> BlockHash:
    """SHA-256 of parent (32 bytes) | count and ids (`_tokens_struct`) | each extra key as a
    u64 length and its UTF-8 bytes: every field has a fixed or stated length, so two different
    inputs never give the same bytes."""
    digest = hashlib.sha256(parent)
    digest.update(_tokens_struct(len(token_ids)).pack(len(token_ids), *token_ids))
    for key in extra_keys:
        data = key.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def sha256_cbor(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys) -> BlockHash:
    """SHA-256 of the canonical CBOR (RFC 8949) of (parent, token ids, extra keys or None), in a
    serialization any language can reproduce: the value vLLM's sha256_cbor hashes, though from
    another root (NONE_HASH), so the digests are not vLLM's."""
    digest = hashlib.sha256(_cbor_head(4, 3))  # the 3-item array
    digest.update(_cbor(parent))
    digest.update(_cbor_token_ids(token_ids))
    digest.update(_cbor(extra_keys or None))
    return digest.digest()


def builtin(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys) -> BlockHash:
    """Python's hash(), 8 bytes, seeded per process by PYTHONHASHSEED. The cheapest, but not
    collision-resistant: 64 bits, and predictable where PYTHONHASHSEED is known, so prompts
    crafted to collide could make the pool compare long lists. For a single user."""
    return hash((parent, tuple(token_ids), extra_keys)).to_bytes(8, "little", signed=True)


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor, "builtin": builtin}
PREFIX_CACHING_HASH_ALGOS = tuple(_HASH_FNS)


def get_hash_fn(algo: str) -> HashFn:
    if algo not in _HASH_FNS:
        raise ValueError(
            f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, got {algo!r}"
        )
    return _HASH_FNS[algo]


def _cbor(value: object) -> bytes:
    """Canonical CBOR of the types a block's hash input holds."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, tuple):
        return _cbor_head(4, len(value)) + b"".join(map(_cbor, value))
    raise TypeError(f"cannot hash a {type(value).__name__} in a block's extra keys")


# A CBOR unsigned int of 2 or 4 bytes: its head byte, then the value, big-endian.
_CBOR_UINT16 = struct.Struct(">BH").pack
_CBOR_UINT32 = struct.Struct(">BI").pack


def _cbor_token_ids(token_ids: Sequence[int]) -> bytes:
    """`_cbor(tuple(token_ids))` with the widths of most ids of a vocabulary (256 to 2**32)
    written inline, not through a call per id (BENCHMARKS.md, "Prefix-cache hashing")."""
    items = [
        _CBOR_UINT16(0x19, t)
        if 256 <= t < 1 << 16
        else _CBOR_UINT32(0x1A, t)
        if 1 << 16 <= t < 1 << 32
        else _cbor(t)
        for t in token_ids
    ]
    return _cbor_head(4, len(items)) + b"".join(items)


def _cbor_head(major: int, argument: int) -> bytes:
    """A data item's head: its major type and argument, in the fewest bytes (canonical)."""
    if argument < 24:
        return bytes((major << 5 | argument,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if argument < 1 << 8 * size:
            return bytes((major << 5 | info,)) + argument.to_bytes(size, "big")
    raise ValueError(f"{argument} does not fit a CBOR integer (64 bits)")
