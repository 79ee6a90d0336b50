"""Times the paged attention kernels: `python -m kernels_pallas.bench [--interpret] [--small]`.

`--sweep-splits` prints decode times per KV split count instead, to check the split heuristic.
Each timed round makes `--calls` back-to-back calls and waits once, so that the host's dispatch
overlaps device work; the median round's time per call counts.

Per case: median time, achieved GB/s from the bytes of K and V the sequences own (what a decode
must read at least), that bandwidth as a fraction of the device-to-device copy bandwidth measured in
the same run, and speedups (other time / our time) over the jnp reference under jit and, for
decode, JAX's own Pallas GPU `paged_attention` (per-layer [K, P, B, H] pages, pre-scaled q).
"""

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged_attention

from kernels_pallas.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

HEAD_DIM = 128
DTYPE = jnp.bfloat16
NUM_LAYERS = 2
LAYER = 1
# The KV of the largest case fits one H100 with room for the reference and JAX's per-layer copy.
MAX_TOKENS_IN_CACHE = 1 << 21
# The reference materializes every sequence's pages in f32; skip it past this many bytes.
MAX_REFERENCE_BYTES = 4 << 30
JAX_K_SPLITS = 16  # JAX's default; it needs pages_per_seq % k_splits == 0


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "decode": one query per sequence; "mixed": those plus one prefill chunk
    batch: int  # decoding sequences
    context: int  # KV length of every sequence
    num_heads: int
    num_kv_heads: int
    prefill_chunk: int = 0  # queries of the extra prefilling sequence ("mixed" only)


def _cases(small: bool, modes: tuple[str, ...]) -> list[Case]:
    if small:
        batches, contexts, heads, chunk = (1, 3), (64, 200), ((8, 2), (16, 2)), 24
    else:
        batches, contexts, heads, chunk = (
            (1, 8, 32, 64, 128, 256),
            (512, 2048, 8192, 32768),
            ((32, 8), (64, 8)),
            512,
        )
    cases = []
    for mode in modes:
        for num_heads, num_kv_heads in heads:
            for batch in batches:
                for context in contexts:
                    prefill_chunk = chunk if mode == "mixed" else 0
                    if (batch + (mode == "mixed")) * context <= MAX_TOKENS_IN_CACHE:
                        cases.append(
                            Case(mode, batch, context, num_heads, num_kv_heads, prefill_chunk)
                        )
    return cases


@dataclasses.dataclass(frozen=True)
class Timing:
    repeats: int  # timed rounds; the median round counts
    calls: int  # back-to-back calls per round, so that host dispatch overlaps device work


def _median_seconds(fn: Callable, *args, timing: Timing) -> float:
    """Median over rounds of the round's wall time per call."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(timing.repeats):
        start = time.perf_counter()
        for _ in range(timing.calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / timing.calls)
    return statistics.median(times)


def _copy_bandwidth(num_bytes: int, timing: Timing) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    seconds = _median_seconds(jax.jit(jnp.copy), x, timing=timing)
    return 2 * num_bytes / seconds


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _make_inputs(case: Case, page_size: int, key: jax.Array) -> dict[str, jax.Array]:
    seq_lens = [case.context] * (case.batch + (case.mode == "mixed"))
    q_lens = [1] * case.batch + ([case.prefill_chunk] if case.mode == "mixed" else [])
    pages_per_seq = _cdiv(case.context, page_size)
    # A multiple of JAX's k_splits so that its kernel accepts the same block tables.
    max_pages = _cdiv(pages_per_seq, JAX_K_SPLITS) * JAX_K_SPLITS
    num_seqs = len(seq_lens)
    num_pages = 1 + num_seqs * pages_per_seq
    key_kv, key_q, key_pages = jax.random.split(key, 3)
    kv_cache = jax.random.normal(
        key_kv, (NUM_LAYERS, 2, case.num_kv_heads, num_pages, page_size, HEAD_DIM), DTYPE
    )
    pages = jax.random.permutation(key_pages, jnp.arange(1, num_pages, dtype=jnp.int32))
    block_tables = jnp.pad(
        pages.reshape(num_seqs, pages_per_seq), ((0, 0), (0, max_pages - pages_per_seq))
    )
    num_tokens = sum(q_lens)
    return {
        "q": jax.random.normal(key_q, (num_tokens, case.num_heads, HEAD_DIM), DTYPE),
        "kv_cache": kv_cache,
        "layer": jnp.int32(LAYER),
        "block_tables": block_tables,
        "seq_lens": jnp.asarray(seq_lens, jnp.int32),
        "query_start_loc": jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    }


def _kv_bytes_read(case: Case) -> int:
    num_seqs = case.batch + (case.mode == "mixed")
    return num_seqs * case.context * case.num_kv_heads * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize


def _run_case(
    case: Case, page_size: int, interpret: bool, timing: Timing
) -> dict[str, float | None]:
    inputs = _make_inputs(case, page_size, jax.random.key(0))
    sm_scale = HEAD_DIM**-0.5
    if case.mode == "decode":
        args = [inputs[k] for k in ("q", "kv_cache", "layer", "block_tables", "seq_lens")]
        ours = jax.jit(
            functools.partial(paged_decode_attention, sm_scale=sm_scale, interpret=interpret)
        )
        reference = jax.jit(functools.partial(paged_decode_attention_reference, sm_scale=sm_scale))
    else:
        args = [
            inputs[k]
            for k in ("q", "kv_cache", "layer", "block_tables", "seq_lens", "query_start_loc")
        ]
        ours = jax.jit(
            functools.partial(ragged_paged_attention, sm_scale=sm_scale, interpret=interpret)
        )
        reference = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))
    result: dict[str, float | None] = {"ours": _median_seconds(ours, *args, timing=timing)}

    num_queries, block_tables = args[0].shape[0], inputs["block_tables"]
    reference_bytes = (
        num_queries * block_tables.shape[1] * page_size * case.num_kv_heads * HEAD_DIM * 8
    )
    result["reference"] = result["error"] = None
    if reference_bytes <= MAX_REFERENCE_BYTES:
        result["reference"] = _median_seconds(reference, *args, timing=timing)
        diff = ours(*args).astype(jnp.float32) - reference(*args).astype(jnp.float32)
        result["error"] = float(jnp.abs(diff).max())

    result["jax"] = None
    if case.mode == "decode":
        # JAX's kernel takes one layer's pages and a pre-scaled q: prepare both outside the timing.
        k_pages, v_pages = jax.block_until_ready(tuple(inputs["kv_cache"][LAYER]))
        q_scaled = jax.block_until_ready(inputs["q"] * sm_scale)
        pages_per_partition = block_tables.shape[1] // JAX_K_SPLITS
        jax_kernel = jax.jit(
            functools.partial(
                jax_paged_attention.paged_attention,
                k_splits=JAX_K_SPLITS,
                interpret=interpret,
                pages_per_compute_block=math.gcd(pages_per_partition, 8),
            )
        )
        result["jax"] = _median_seconds(
            jax_kernel,
            q_scaled,
            k_pages,
            v_pages,
            block_tables,
            inputs["seq_lens"],
            timing=timing,
        )
    return result


def _sweep_splits(cases: list[Case], page_size: int, interpret: bool, timing: Timing) -> None:
    """Decode time per KV split count: what `default_num_kv_splits` should pick per case."""
    splits = (1, 2, 4, 8, 16, 32, 64)
    print(
        f"{'batch':>5} {'context':>7} {'N:K':>6} {'auto':>7}" + "".join(f"{j:>7}" for j in splits)
    )
    sm_scale = HEAD_DIM**-0.5
    for case in cases:
        inputs = _make_inputs(case, page_size, jax.random.key(0))
        args = [inputs[k] for k in ("q", "kv_cache", "layer", "block_tables", "seq_lens")]
        row = []
        for num_kv_splits in (None, *splits):
            fn = jax.jit(
                functools.partial(
                    paged_decode_attention,
                    sm_scale=sm_scale,
                    num_kv_splits=num_kv_splits,
                    interpret=interpret,
                )
            )
            row.append(f"{_median_seconds(fn, *args, timing=timing) * 1e6:>7.0f}")
        heads = f"{case.num_heads}:{case.num_kv_heads}"
        print(f"{case.batch:>5} {case.context:>7} {heads:>6} " + "".join(row))


def _ratio(other: float | None, ours: float) -> str:
    return "-" if other is None else f"{other / ours:.2f}x"


def attention_parser(description: str) -> argparse.ArgumentParser:
    """The flags of the paged attention benchmarks: --interpret, --small, --page-size, --repeats,
    --calls (read back by `timing_of`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--interpret", action="store_true", help="run the kernels in interpret mode (CPU)"
    )
    parser.add_argument("--small", action="store_true", help="tiny cases, to check the script runs")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed round")
    return parser


def timing_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Timing:
    """The rounds of `attention_parser`'s flags; a few single calls in interpret mode."""
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be >= 1")
    return Timing(repeats=3, calls=1) if args.interpret else Timing(args.repeats, args.calls)


def main() -> None:
    parser = attention_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("decode", "mixed", "both"), default="both")
    parser.add_argument(
        "--sweep-splits",
        action="store_true",
        help="decode only: time (us) per KV split count instead of the comparison table",
    )
    args = parser.parse_args()
    timing = timing_of(parser, args)

    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"H={HEAD_DIM}, {jnp.dtype(DTYPE).name}, page size {args.page_size}"
    )
    copy_bytes = (16 << 20) if args.small else (2 << 30)
    copy_bandwidth = _copy_bandwidth(copy_bytes, timing)
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.1f} GB/s (read + write)")
    if args.sweep_splits:
        # The split count matters through S * K programs; G is padded to 16 rows whatever N:K is.
        cases = [c for c in _cases(args.small, ("decode",)) if c.num_heads == c.num_kv_heads * 4]
        _sweep_splits(cases, args.page_size, args.interpret, timing)
        return
    header = (
        f"{'mode':>6} {'batch':>5} {'context':>7} {'N:K':>6} {'time us':>10} {'GB/s':>8} "
        f"{'of copy':>7} {'vs ref':>7} {'vs jax':>7} {'max err':>8}"
    )
    print(header)
    modes = ("decode", "mixed") if args.mode == "both" else (args.mode,)
    for case in _cases(args.small, modes):
        r = _run_case(case, args.page_size, args.interpret, timing)
        bandwidth = _kv_bytes_read(case) / r["ours"]
        error = "-" if r["error"] is None else f"{r['error']:.1e}"
        print(
            f"{case.mode:>6} {case.batch:>5} {case.context:>7} "
            f"{f'{case.num_heads}:{case.num_kv_heads}':>6} {r['ours'] * 1e6:>10.1f} "
            f"{bandwidth / 1e9:>8.1f} {bandwidth / copy_bandwidth:>7.2f} "
            f"{_ratio(r['reference'], r['ours']):>7} {_ratio(r['jax'], r['ours']):>7} {error:>8}"
        )


if __name__ == "__main__":
    main()
