"""One MoE layer over T devices: expert parallelism (each device E/T whole experts) against
tensor parallelism (each device 1/T of every expert's F), as the engine runs them.

    python -m jvllm.benchmarks.moe_parallel                        # T = 2 and 4, tiny and Qwen3
    python -m jvllm.benchmarks.moe_parallel --tensor-parallel-size 4 --num-tokens 1 64

For each shape, T and token count: the median wall time of several jitted calls of the layer
inside `shard_map` (`route` on every device, `moe_mlp` on the device's experts, then the one
all-reduce), after a warm-up call that compiles it, and the ratio expert / tensor (below 1:
expert parallelism is faster). Weights are random like `--load-format dummy`, in --dtype,
placed as each layout places them (gate|up not laid out shard-major under tensor parallelism:
the values are meaningless either way, the work is the layout's). On a CPU the T devices are
fake (XLA_FLAGS, set here before JAX starts its backend) and share its cores: the ratio
compares the two layouts' work, not a speed-up over one device.
"""

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jvllm.benchmarks.moe import SHAPES, MoEShape, cell, cpu_name, random_weights
from jvllm.benchmarks.workload import median_time
from jvllm.distributed.mesh import ensure_cpu_devices, make_mesh
from jvllm.layers.moe import moe_mlp, route
from jvllm.layers.parallel import first_local_expert, sum_over_shards
from jvllm.layers.params import TP_AXIS


def _layer(mesh, shape: MoEShape, is_expert_parallel: bool):
    """(the jitted layer (x, router, gate_up, down) -> f32[T, D] over `mesh`'s "model" axis,
    the PartitionSpecs of its gate_up [E, D, 2F] and down [E, F, D])."""
    t = mesh.shape[TP_AXIS]
    num_expert_shards = t if is_expert_parallel else 1
    num_local_experts = shape.num_experts // num_expert_shards

    def layer(x, router, gate_up, down):
        weights, experts = route(x, router, shape.top_k, shape.renormalize)
        first = first_local_expert(num_local_experts, num_expert_shards)
        return sum_over_shards(moe_mlp(x, weights, experts, gate_up, down, first), t)

    if is_expert_parallel:  # by expert
        specs = PartitionSpec(TP_AXIS), PartitionSpec(TP_AXIS)
    else:  # by F
        specs = PartitionSpec(None, None, TP_AXIS), PartitionSpec(None, TP_AXIS)
    whole = PartitionSpec()
    mapped = jax.shard_map(
        layer, mesh=mesh, in_specs=(whole, whole, *specs), out_specs=whole, check_vma=False
    )
    # The benchmark's own jit, not one of the engine's entry points (those are in the runner).
    return jax.jit(mapped), specs


def _seconds(call, inputs: tuple, num_iters: int) -> float:
    """The median wall time of call(*inputs), after a call that compiles it."""
    run = lambda _: jax.block_until_ready(call(*inputs))
    run(None)
    return median_time(run, num_iters)


def _bench(name: str, t: int, args) -> None:
    """One table row per --num-tokens; the weights are drawn once for both layouts."""
    shape = SHAPES[name]
    if shape.num_experts % t:
        print(f"{name:<15} {t:>2} skipped: {shape.num_experts} experts do not divide over {t}")
        return
    mesh = make_mesh(1, t)
    router, gate_up, down = random_weights(shape, jnp.dtype(args.dtype))
    layouts = []
    for is_expert_parallel in (False, True):
        call, specs = _layer(mesh, shape, is_expert_parallel)
        shardings = tuple(NamedSharding(mesh, s) for s in (PartitionSpec(), *specs))
        placed = jax.block_until_ready(jax.device_put((router, gate_up, down), shardings))
        layouts.append((call, placed))
    for num_tokens in args.num_tokens:
        x = jax.random.normal(jax.random.key(1), (num_tokens, shape.hidden_size), args.dtype)
        tensor, expert = (_seconds(call, (x, *placed), args.num_iters) for call, placed in layouts)
        print(
            f"{name:<15} {t:>2} {num_tokens:>6} {cell(tensor, True):>12} "
            f"{cell(expert, True):>12} {expert / tensor:>13.2f}x"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=list(SHAPES), default=["tiny", "qwen3-30b-a3b"]
    )
    parser.add_argument("--tensor-parallel-size", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--num-tokens", nargs="+", type=int, default=[1, 64, 512])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-iters", type=int, default=5)
    args = parser.parse_args(argv)
    ensure_cpu_devices(max(args.tensor_parallel_size))  # before JAX starts its backend

    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), CPU: {cpu_name()}, "
        f"{args.dtype}, random weights (load_format dummy), median of {args.num_iters} calls"
    )
    print(
        f"{'shape':<15} {'T':>2} {'tokens':>6} {'tensor (ms)':>12} {'expert (ms)':>12} "
        f"{'expert/tensor':>14}"
    )
    for name in args.shapes:
        for t in args.tensor_parallel_size:
            _bench(name, t, args)


if __name__ == "__main__":
    main()
