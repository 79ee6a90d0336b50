"""What a round's n-gram lookup costs inside a window of speculative rounds (issue 49): the
device's lookup (spec_decode/ngram_device.py, each row's tokens read through its block table)
against the host's (spec_decode/ngram.py, NumPy over each request's tokens, as the scheduler
runs it every step outside windows), for S rows of one length in a block table of max_model_len.

    python -m jvllm.benchmarks.ngram_lookup                       # the default grid
    python -m jvllm.benchmarks.ngram_lookup --rows 8 --lengths 600,32000 --max-model-len 32768

Prints, for each (rows, length), the median over --num-iters of the milliseconds one lookup of
every row takes on each side, and their ratio. Tokens are random ids below 50 (n-grams recur).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.benchmarks.startup import cpu_name
from jvllm.spec_decode.ngram import propose_ngram_drafts
from jvllm.spec_decode.ngram_device import propose_ngram_on_device
from jvllm.worker.spec_window import paged_tokens


def _median_ms(call, num_iters: int) -> float:
    call()  # compiled, or warm
    times = []
    for _ in range(num_iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lookup_ms(num_rows: int, length: int, args: argparse.Namespace) -> tuple[float, float]:
    """(device, host) median milliseconds of one lookup for `num_rows` rows of `length` tokens."""
    block_size, num_pages = args.block_size, -(-args.max_model_len // args.block_size)
    rng = np.random.default_rng(0)
    history = rng.integers(0, 50, (num_rows, num_pages * block_size)).astype(np.int32)
    tables = 1 + rng.permutation(num_rows * num_pages).reshape(num_rows, num_pages)
    token_cache = np.zeros((1 + num_rows * num_pages, block_size), np.int32)
    token_cache[tables] = history.reshape(num_rows, num_pages, block_size)
    lengths = np.full(num_rows, length, np.int32)
    min_n, max_n = args.prompt_lookup_min, args.prompt_lookup_max

    @jax.jit
    def device(token_cache, tables, lengths):
        last = lengths - 1
        tokens = paged_tokens(token_cache, tables, last, history_at(token_cache, tables, last))
        return propose_ngram_on_device(tokens, lengths, min_n, max_n, args.num_drafts)

    def history_at(token_cache, tables, last):  # each row's own last token, where it stands
        return token_cache[tables[jnp.arange(num_rows), last // block_size], last % block_size]

    arrays = tuple(map(jnp.asarray, (token_cache, tables, lengths)))
    rows = [history[row, :length] for row in range(num_rows)]
    return (
        _median_ms(lambda: jax.block_until_ready(device(*arrays)), args.num_iters),
        _median_ms(
            lambda: [propose_ngram_drafts(r, min_n, max_n, args.num_drafts) for r in rows],
            args.num_iters,
        ),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64", help="rows a lookup, comma-separated")
    parser.add_argument("--lengths", default="512,4096,32000", help="tokens a row")
    parser.add_argument("--max-model-len", type=int, default=32768, help="the block table's width")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-drafts", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--num-iters", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_name()}, JAX {jax.__version__} on {jax.default_backend()}")
    print(
        f"block table of {args.max_model_len} tokens, k = {args.num_drafts}, n in "
        f"[{args.prompt_lookup_min}, {args.prompt_lookup_max}], median of {args.num_iters}"
    )
    print(f"{'rows':>5} {'length':>7} {'device ms':>10} {'host ms':>9} {'host/device':>12}")
    for num_rows in map(int, args.rows.split(",")):
        for length in map(int, args.lengths.split(",")):
            if length > args.max_model_len:
                continue
            device, host = lookup_ms(num_rows, length, args)
            print(f"{num_rows:>5} {length:>7} {device:>10.3f} {host:>9.3f} {host / device:>11.2f}x")


if __name__ == "__main__":
    main()
