"""Times the dequantizing matmuls on Llama-3-8B's decode shapes:
`python -m kernels_pallas.bench_dequant_matmul [--interpret] [--small] [--sweep]`.

Per (format, I -> O, M): the kernel's median time per call, the bytes of its quantized weight
read per second (what a batch-1 decode must read at least) and that as a fraction of the
device-to-device copy bandwidth measured in the same run, and speedups (other time / ours) over
a bfloat16 matmul of the same shape and over what the engine runs without the kernel (the weight
dequantized by XLA, then one matmul: the references under jit). `--sweep` times every tiling of
SWEEP instead and prints the fastest few per case.
"""

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.bench import Timing, _copy_bandwidth, _median_seconds
from kernels_pallas.dequant_matmul import int_matmul, int_matmul_reference
from kernels_pallas.fp8_block_matmul import fp8_block_matmul, fp8_block_matmul_reference

# Llama-3-8B's projections (I -> O): qkv, gate or up, down.
SHAPES = [(4096, 6144), (4096, 14336), (14336, 4096)]
SMALL_SHAPES = [(256, 96), (384, 200)]
# name: (bits, group size (None: the whole row), symmetric, scale dtype); "fp8": 128 x 128 blocks.
FORMATS = {
    "int4": (4, 128, True, jnp.float16),  # GPTQ's W4A16
    "int4-zp": (4, 128, False, jnp.bfloat16),  # AWQ's / compressed-tensors' asymmetric
    "int8": (8, None, True, jnp.bfloat16),  # W8A16 per channel
    "fp8": None,
}
FP8_BLOCK = (128, 128)
SWEEP = {
    "block_o": (16, 32, 64, 128),
    "block_k": (256, 512, 1024),
    "num_k_splits": (None, 1, 2, 4, 8),
}
_CONTRACT_LAST = (((1,), (1,)), ((), ()))


def _weight(fmt: str, num_in: int, num_out: int, key: jax.Array):
    """-> (kernel(x, **tiling), reference(x), quantized fields): a random weight of `fmt`."""
    key_values, key_scale, key_zero = jax.random.split(key, 3)
    if fmt == "fp8":
        values = jax.random.normal(key_values, (num_out, num_in)).astype(jnp.float8_e4m3fn)
        scale_shape = (-(-num_out // FP8_BLOCK[0]), -(-num_in // FP8_BLOCK[1]))
        scale = jax.random.uniform(key_scale, scale_shape, minval=1e-3, maxval=1e-2)
        fields = (values, scale)
        kernel = functools.partial(fp8_block_matmul, block=FP8_BLOCK)
        reference = functools.partial(fp8_block_matmul_reference, block=FP8_BLOCK)
    else:
        bits, group_size, is_symmetric, scale_dtype = FORMATS[fmt]
        group_size = group_size or num_in
        groups = (num_out, num_in // group_size)
        packed = jax.random.randint(key_values, (num_out, num_in * bits // 8), 0, 256, jnp.int32)
        scale = jax.random.uniform(key_scale, groups, minval=1e-3, maxval=1e-2).astype(scale_dtype)
        zero = None
        if not is_symmetric:
            zero = jax.random.randint(key_zero, groups, 0, 1 << bits, jnp.int32).astype(jnp.int16)
        fields = (packed.astype(jnp.uint8), scale, zero)
        options = {"bits": bits, "group_size": group_size}
        kernel = functools.partial(int_matmul, **options)
        reference = functools.partial(int_matmul_reference, **options)
    return kernel, reference, fields


def _num_bytes(fields) -> int:
    return sum(f.nbytes for f in fields if f is not None)


def _bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return lax.dot_general(x, w, _CONTRACT_LAST, preferred_element_type=jnp.float32)


def _run_case(fmt, num_in, num_out, num_rows, interpret, timing, copy_bandwidth) -> str:
    key_w, key_x, key_dense = jax.random.split(jax.random.key(0), 3)
    kernel, reference, fields = _weight(fmt, num_in, num_out, key_w)
    x = jax.random.normal(key_x, (num_rows, num_in), jnp.bfloat16)
    ours = jax.jit(lambda x, *f: kernel(x, *f, interpret=interpret))
    seconds = _median_seconds(ours, x, *fields, timing=timing)
    xla = _median_seconds(jax.jit(reference), x, *fields, timing=timing)
    dense = jax.random.normal(key_dense, (num_out, num_in), jnp.bfloat16)
    bf16 = _median_seconds(jax.jit(_bf16_matmul), x, dense, timing=timing)
    ref = reference(x, *fields)
    error = float(jnp.abs(ours(x, *fields) - ref).max() / jnp.abs(ref).max())
    bandwidth = _num_bytes(fields) / seconds
    return (
        f"{fmt:>8} {f'{num_in}->{num_out}':>11} {num_rows:>4} {seconds * 1e6:>9.1f} "
        f"{bandwidth / 1e9:>8.1f} {bandwidth / copy_bandwidth:>7.2f} {bf16 / seconds:>7.2f}x "
        f"{xla / seconds:>7.2f}x {error:>8.1e}"
    )


def _sweep_case(fmt, num_in, num_out, num_rows, interpret, timing, top: int = 3) -> None:
    key_w, key_x = jax.random.split(jax.random.key(0))
    kernel, _, fields = _weight(fmt, num_in, num_out, key_w)
    x = jax.random.normal(key_x, (num_rows, num_in), jnp.bfloat16)
    results = []
    for values in itertools.product(*SWEEP.values()):
        tiling = dict(zip(SWEEP, values, strict=True))
        fn = jax.jit(lambda x, *f, tiling=tiling: kernel(x, *f, interpret=interpret, **tiling))
        results.append((_median_seconds(fn, x, *fields, timing=timing), tiling))
    results.sort(key=lambda r: r[0])
    default = jax.jit(lambda x, *f: kernel(x, *f, interpret=interpret))
    default_us = _median_seconds(default, x, *fields, timing=timing) * 1e6
    best = ", ".join(f"{s * 1e6:.1f} us {t}" for s, t in results[:top])
    print(f"{fmt} {num_in}->{num_out} M={num_rows}: default {default_us:.1f} us; best {best}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--interpret", action="store_true", help="run the kernels in interpret mode (CPU)"
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes, to check the script")
    parser.add_argument("--rows", default="1,4,16", help="comma-separated M (tokens) to time")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"among {list(FORMATS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per round")
    parser.add_argument("--sweep", action="store_true", help="time the tilings of SWEEP instead")
    args = parser.parse_args()
    formats = args.formats.split(",")
    if unknown := set(formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}; choose among {list(FORMATS)}")
    rows = [int(r) for r in args.rows.split(",")]
    timing = Timing(repeats=2, calls=1) if args.interpret else Timing(args.repeats, args.calls)
    shapes = SMALL_SHAPES if args.small else SHAPES

    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, x bfloat16")
    if args.sweep:
        for fmt, (num_in, num_out), num_rows in itertools.product(formats, shapes, rows):
            _sweep_case(fmt, num_in, num_out, num_rows, args.interpret, timing)
        return
    copy_bandwidth = _copy_bandwidth((16 << 20) if args.small else (2 << 30), timing)
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.1f} GB/s (read + write)")
    print(
        f"{'format':>8} {'I->O':>11} {'M':>4} {'time us':>9} {'GB/s':>8} {'of copy':>7} "
        f"{'vs bf16':>8} {'vs xla':>8} {'rel err':>8}"
    )
    for fmt, (num_in, num_out), num_rows in itertools.product(formats, shapes, rows):
        print(_run_case(fmt, num_in, num_out, num_rows, args.interpret, timing, copy_bandwidth))


if __name__ == "__main__":
    main()
