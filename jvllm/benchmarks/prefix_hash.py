"""What each `prefix_caching_hash_algo` costs the host: the prefix-cache lookup of a prompt on an
empty cache, which hashes every full block of it (and misses at the first).

    python -m jvllm.benchmarks.prefix_hash                  # 1024-token prompts, blocks of 16
    python -m jvllm.benchmarks.prefix_hash --cache-salt s   # with a salt on the first block

Prints, for each algorithm, the median over --num-iters prompts of the microseconds one lookup
takes, per prompt and per block. Prompts are random token ids below SmolLM2's vocabulary size.
"""

import argparse
import platform
import random
import statistics
import time

from jvllm.benchmarks.startup import cpu_name
from jvllm.core.block_hash import PREFIX_CACHING_HASH_ALGOS
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request
from jvllm.sampling_params import SamplingParams

_VOCAB_SIZE = 49152


def lookup_microseconds(algo: str, args: argparse.Namespace) -> float:
    """Median microseconds of `get_computed_blocks` on a fresh prompt and an empty cache."""
    kv = KVCacheManager(num_blocks=2, block_size=args.block_size, hash_algo=algo)
    rng = random.Random(0)
    params = SamplingParams()
    times = []
    for i in range(args.num_iters):
        prompt = [rng.randrange(_VOCAB_SIZE) for _ in range(args.num_tokens)]
        request = Request(str(i), prompt, params, eos_token_id=None, cache_salt=args.cache_salt)
        start = time.perf_counter()
        kv.get_computed_blocks(request)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=1024, help="tokens a prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-iters", type=int, default=500, help="prompts per algorithm")
    parser.add_argument("--cache-salt", default=None, help="the prompts' cache_salt")
    args = parser.parse_args(argv)
    num_blocks = args.num_tokens // args.block_size
    print(f"CPU: {cpu_name()}, Python {platform.python_version()}")
    print(
        f"{args.num_tokens}-token prompts ({num_blocks} blocks of {args.block_size}), "
        f"median of {args.num_iters}, cache_salt={args.cache_salt!r}"
    )
    print(f"{'algo':<12} {'us/prompt':>10} {'us/block':>9}")
    for algo in PREFIX_CACHING_HASH_ALGOS:
        micros = lookup_microseconds(algo, args)
        print(f"{algo:<12} {micros:>10.1f} {micros / max(num_blocks, 1):>9.2f}")


if __name__ == "__main__":
    main()
