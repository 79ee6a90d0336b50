"""Times MLA decode on DeepSeek-V3's shapes:
`python -m kernels_pallas.bench_mla [--interpret] [--small] [--sweep]`.

Per (batch, context), 128 heads over the latent cache [L, 1, 1, P, 16, 512 + 64] in bfloat16:
mla_decode_attention's median time per call, the bytes of latent rows the sequences own over
that time (S * context * 576 * 2 bytes, what a decode must read at least), that as a fraction of
the device-to-device copy bandwidth measured in the same run, the speedup (other time / ours)
over the generic paged_decode_attention on the same cache (one KV head of 128 query heads, 576
padded to 1024 columns, each row read for K and again for V), and the largest difference from
the jnp reference. `--sweep` times heads per program and KV split counts instead.
"""

import functools
import itertools

import jax
import jax.numpy as jnp

from kernels_pallas.bench import (
    Timing,
    _copy_bandwidth,
    _median_seconds,
    attention_parser,
    timing_of,
)
from kernels_pallas.mla_decode_attention import (
    mla_decode_attention,
    mla_decode_attention_reference,
)
from kernels_pallas.paged_decode_attention import paged_decode_attention

NUM_HEADS = 128
LATENT_DIM = 512  # C, kv_lora_rank
ROPE_DIM = 64  # R, qk_rope_head_dim
DTYPE = jnp.bfloat16
NUM_LAYERS = 2
LAYER = 1
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 32768)
SMALL = {"batches": (1, 3), "contexts": (64, 200), "num_heads": 16}
# The reference materializes each sequence's rows and logits in f32; skip it past this many bytes.
MAX_REFERENCE_BYTES = 4 << 30
SWEEP = {"heads_per_program": (16, 32, 64), "num_kv_splits": (None, 2, 8, 32)}


def _make_inputs(batch: int, context: int, num_heads: int, page_size: int, key: jax.Array):
    """(q [S, N, C + R], kv_cache [L, 1, 1, P, B, C + R], layer, block_tables, seq_lens):
    every sequence `context` long, its pages shuffled through the pool."""
    pages_per_seq = -(-context // page_size)
    num_pages = 1 + batch * pages_per_seq
    key_kv, key_q, key_pages = jax.random.split(key, 3)
    head_dim = LATENT_DIM + ROPE_DIM
    kv_cache = jax.random.normal(key_kv, (NUM_LAYERS, 1, 1, num_pages, page_size, head_dim), DTYPE)
    pages = jax.random.permutation(key_pages, jnp.arange(1, num_pages, dtype=jnp.int32))
    return (
        jax.random.normal(key_q, (batch, num_heads, head_dim), DTYPE),
        kv_cache,
        jnp.int32(LAYER),
        pages.reshape(batch, pages_per_seq),
        jnp.full((batch,), context, jnp.int32),
    )


def _latent_bytes(batch: int, context: int) -> int:
    return batch * context * (LATENT_DIM + ROPE_DIM) * jnp.dtype(DTYPE).itemsize


def _generic_seconds(args, sm_scale: float, interpret: bool, timing: Timing) -> float | None:
    """paged_decode_attention's time on the same cache; None where it does not compile (its
    one program holds all N heads' [N, 1024] accumulator)."""
    fn = jax.jit(functools.partial(paged_decode_attention, sm_scale=sm_scale, interpret=interpret))
    try:
        return _median_seconds(fn, *args, timing=timing)
    except jax.errors.JaxRuntimeError as error:  # a Triton resource limit: time the rest
        print(f"  generic kernel failed: {type(error).__name__}: {str(error)[:200]}")
        return None


def _run_case(batch, context, num_heads, page_size, interpret, timing, copy_bandwidth) -> str:
    args = _make_inputs(batch, context, num_heads, page_size, jax.random.key(0))
    options = {"latent_dim": LATENT_DIM, "sm_scale": (LATENT_DIM + ROPE_DIM) ** -0.5}
    ours = jax.jit(functools.partial(mla_decode_attention, **options, interpret=interpret))
    seconds = _median_seconds(ours, *args, timing=timing)
    bandwidth = _latent_bytes(batch, context) / seconds
    generic = _generic_seconds(args, options["sm_scale"], interpret, timing)
    error = "-"
    if 4 * batch * context * (LATENT_DIM + ROPE_DIM + num_heads) <= MAX_REFERENCE_BYTES:
        reference = jax.jit(functools.partial(mla_decode_attention_reference, **options))
        diff = ours(*args).astype(jnp.float32) - reference(*args).astype(jnp.float32)
        error = f"{float(jnp.abs(diff).max()):.1e}"
    vs_generic = "-" if generic is None else f"{generic / seconds:.2f}x"
    return (
        f"{batch:>5} {context:>7} {num_heads:>5} {seconds * 1e6:>10.1f} {bandwidth / 1e9:>8.1f} "
        f"{bandwidth / copy_bandwidth:>7.2f} {vs_generic:>10} {error:>8}"
    )


def _sweep_case(batch, context, num_heads, page_size, interpret, timing) -> None:
    """Time (us) per heads_per_program (rows) and KV split count (columns; None: the default)."""
    args = _make_inputs(batch, context, num_heads, page_size, jax.random.key(0))
    kernel = functools.partial(
        mla_decode_attention,
        latent_dim=LATENT_DIM,
        sm_scale=(LATENT_DIM + ROPE_DIM) ** -0.5,
        interpret=interpret,
    )
    print(f"batch {batch}, context {context}: heads per program \\ splits {SWEEP['num_kv_splits']}")
    for heads in SWEEP["heads_per_program"]:
        tilings = (
            functools.partial(kernel, heads_per_program=heads, num_kv_splits=num_kv_splits)
            for num_kv_splits in SWEEP["num_kv_splits"]
        )
        times = (_median_seconds(jax.jit(fn), *args, timing=timing) for fn in tilings)
        print(f"{heads:>5} " + "".join(f"{seconds * 1e6:>9.1f}" for seconds in times))


def main() -> None:
    parser = attention_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--batches", help="comma-separated batch sizes (default: 1,8,32)")
    parser.add_argument("--contexts", help="comma-separated context lengths (default: 4096,32768)")
    parser.add_argument(
        "--sweep", action="store_true", help="time heads per program and KV splits instead"
    )
    args = parser.parse_args()
    timing = timing_of(parser, args)
    batches, contexts, num_heads = (
        (SMALL["batches"], SMALL["contexts"], SMALL["num_heads"])
        if args.small
        else (BATCHES, CONTEXTS, NUM_HEADS)
    )
    print(
        f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, C={LATENT_DIM}, "
        f"R={ROPE_DIM}, {jnp.dtype(DTYPE).name}, page size {args.page_size}"
    )
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    cases = list(itertools.product(batches, contexts))
    if args.sweep:
        for batch, context in cases:
            _sweep_case(batch, context, num_heads, args.page_size, args.interpret, timing)
        return
    copy_bandwidth = _copy_bandwidth((16 << 20) if args.small else (2 << 30), timing)
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.1f} GB/s (read + write)")
    print(
        f"{'batch':>5} {'context':>7} {'N':>5} {'time us':>10} {'GB/s':>8} {'of copy':>7} "
        f"{'vs generic':>10} {'max err':>8}"
    )
    for batch, context in cases:
        print(
            _run_case(
                batch, context, num_heads, args.page_size, args.interpret, timing, copy_bandwidth
            )
        )


if __name__ == "__main__":
    main()
