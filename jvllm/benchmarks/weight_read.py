"""The batch-1 decode floor on this device: a decode step reads its weights once, so it takes at
least their bytes over the device's memory bandwidth.

    python -m jvllm.benchmarks.weight_read --model jvllm/benchmarks/model_configs/llama-3-8b \
        --dtype bfloat16

The bytes come from the model's config.json alone (nothing is loaded), in the model dtype
(quantized weights are not counted): every param, less the embedding table when the LM head is
a matrix of its own (a step reads one row of the table per token), and of a mixture of experts'
expert weights the num_experts_per_tok experts a token is routed to. The bandwidth is the
device's read rate: a jitted sum over a buffer of --read-mib MiB, median of --num-iters. A read,
not a copy, since a step reads its weights and writes next to nothing (and XLA:CPU's copies run
far below the read rate: BENCHMARKS.md, "Current figures"). Put the throughput benchmark's
batch-1 step beside the floor printed here: their ratio is what host work, attention and the
kernels' own inefficiency cost a token.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jvllm.model_loader.default_model import default_model_dir
from jvllm.model_loader.hf import read_hf_config
from jvllm.models.model import param_axes, param_shapes


def decode_weight_bytes(config) -> int:
    """Bytes of weights one batch-1 decode step reads."""
    shapes, axes = param_shapes(config), param_axes(config)
    if not config.tie_word_embeddings:  # the LM head is read; of the table, one row
        table = shapes["embed"]["embedding"]  # [V, D]
        shapes["embed"]["embedding"] = jax.ShapeDtypeStruct(table.shape[1:], table.dtype)

    def read_bytes(leaf, names) -> float:
        share = 1.0
        if "experts" in names and "mlp" in names:  # an expert weight; the router is read whole
            share = config.num_experts_per_tok / config.num_experts
        return share * leaf.size * jnp.dtype(leaf.dtype).itemsize

    # axes holds a tuple of names where shapes holds a leaf: each pair meets in read_bytes.
    return round(sum(jax.tree.leaves(jax.tree.map(read_bytes, shapes, axes))))


# The benchmark's own jit, not one of the engine's entry points (those are in the model runner).
@jax.jit
def _read(x):
    return jnp.sum(x)


def read_bandwidth(num_bytes: int, num_iters: int) -> float:
    """Bytes a second that a jitted sum reads on the default device."""
    # Two buffers in turn, so that no pass finds its input in a cache the last one filled.
    buffers = [jnp.full((num_bytes // 4,), i, jnp.float32) for i in range(2)]
    jax.block_until_ready([_read(b) for b in buffers])  # compile
    seconds = []
    for i in range(num_iters):
        start = time.perf_counter()
        jax.block_until_ready(_read(buffers[i % 2]))
        seconds.append(time.perf_counter() - start)
    return buffers[0].nbytes / statistics.median(seconds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--read-mib", type=int, default=1024)
    parser.add_argument("--num-iters", type=int, default=20)
    args = parser.parse_args(argv)
    if args.read_mib < 1 or args.num_iters < 1:
        parser.error("--read-mib and --num-iters must be at least 1")

    config = read_hf_config(args.model or default_model_dir(), args.dtype)
    weight_bytes = decode_weight_bytes(config)
    bandwidth = read_bandwidth(args.read_mib << 20, args.num_iters)
    floor = weight_bytes / bandwidth
    print(f"device: {jax.devices()[0].device_kind}")
    print(
        f"weights a batch-1 decode step reads: {weight_bytes / 1e6:.1f} MB ({args.dtype}); "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s (a sum over {args.read_mib} MiB, "
        f"median of {args.num_iters})"
    )
    print(f"batch-1 decode floor: {floor * 1e3:.3f} ms a step, {1 / floor:.1f} tok/s")


if __name__ == "__main__":
    main()
