"""One MoE layer, grouped (moe_mlp, ragged_dot) against every expert on every token (dense).

    python -m jvllm.benchmarks.moe                                   # every shape, T 1 64 512
    python -m jvllm.benchmarks.moe --shapes qwen3-30b-a3b --num-tokens 1 64

For each shape and token count T: the median wall time of several jitted calls of the layer
(`route`, then `moe_mlp` or `dense_moe_mlp`) after a warm-up call that compiles it, and the ratio
grouped / dense (below 1: grouped is faster). Weights are random like `--load-format dummy`
(uniform in [-1e-3, 1e-3]), in --dtype. A case whose warm-up call takes longer than
--max-call-seconds is not repeated: its figure is that one call, compile included, marked "~".
A case whose dense layer does more than --max-tflop is skipped, and says so: by default
Mixtral-8x7B at 512 tokens (1.4 TFLOP), about a minute and 17 GB on a 2-core CPU.
"""

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jvllm.benchmarks.startup import cpu_name
from jvllm.benchmarks.workload import median_time
from jvllm.layers.moe import dense_moe_mlp, moe_mlp, route


@dataclasses.dataclass(frozen=True)
class MoEShape:
    hidden_size: int  # D
    intermediate_size: int  # F, per expert
    num_experts: int  # E
    top_k: int  # k
    renormalize: bool

    def dense_tflop(self, num_tokens: int) -> float:
        """The dense layer's work: three [D, F] projections per expert and token."""
        return 6 * num_tokens * self.num_experts * self.hidden_size * self.intermediate_size / 1e12


SHAPES = {
    "tiny": MoEShape(32, 64, 8, 2, True),
    # Qwen3-30B-A3B's moe_intermediate_size, num_experts, num_experts_per_tok, norm_topk_prob.
    "qwen3-30b-a3b": MoEShape(2048, 768, 128, 8, True),
    "mixtral-8x7b": MoEShape(4096, 14336, 8, 2, True),
}
_IMPLS = {"grouped": moe_mlp, "dense": dense_moe_mlp}
_BOUND = 1e-3  # as load_format "dummy"


# The benchmark's own jit, not one of the engine's entry points (those are in the model runner).
@functools.partial(jax.jit, static_argnames=("shape", "impl"))
def _layer(x, router, gate_up, down, *, shape: MoEShape, impl: str):
    weights, experts = route(x, router, shape.top_k, shape.renormalize)
    return _IMPLS[impl](x, weights, experts, gate_up, down)


def random_weights(shape: MoEShape, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """router [E, D], gate_up [E, D, 2F], down [E, F, D], uniform in [-_BOUND, _BOUND]."""
    d, f, e = shape.hidden_size, shape.intermediate_size, shape.num_experts
    keys = jax.random.split(jax.random.key(0), 3)
    arrays = tuple(
        jax.random.uniform(key, dims, dtype, -_BOUND, _BOUND)
        for key, dims in zip(keys, [(e, d), (e, d, 2 * f), (e, f, d)])
    )
    return jax.block_until_ready(arrays)  # drawn before any call is timed


def _layer_seconds(x, params, shape, impl, args) -> tuple[float, bool]:
    """(seconds a call, whether it is a median of --num-iters; else the one warm-up call)."""

    def run(_):
        jax.block_until_ready(_layer(x, *params, shape=shape, impl=impl))

    start = time.perf_counter()
    run(None)
    warm_up = time.perf_counter() - start
    if warm_up > args.max_call_seconds:
        return warm_up, False
    return median_time(run, args.num_iters), True


def cell(seconds: float, is_median: bool) -> str:
    ms = seconds * 1e3
    return ("" if is_median else "~") + (f"{ms:.1f}" if ms >= 10 else f"{ms:.3f}")


def _bench_shape(name: str, args) -> None:
    """One table row per --num-tokens; the weights are drawn only if a row runs."""
    shape, params = SHAPES[name], None
    for num_tokens in args.num_tokens:
        tflop = shape.dense_tflop(num_tokens)
        if tflop > args.max_tflop:
            print(
                f"{name:<15} {num_tokens:>5} skipped: dense {tflop:.2f} TFLOP > --max-tflop "
                f"{args.max_tflop:g}"
            )
            continue
        if params is None:
            params = random_weights(shape, jnp.dtype(args.dtype))
        x = jax.random.normal(jax.random.key(1), (num_tokens, shape.hidden_size), args.dtype)
        grouped = _layer_seconds(x, params, shape, "grouped", args)
        dense = _layer_seconds(x, params, shape, "dense", args)
        print(
            f"{name:<15} {num_tokens:>5} {cell(*grouped):>13} {cell(*dense):>11} "
            f"{grouped[0] / dense[0]:>13.2f}x"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--num-tokens", nargs="+", type=int, default=[1, 64, 512])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--max-call-seconds", type=float, default=10.0)
    parser.add_argument("--max-tflop", type=float, default=1.0)
    args = parser.parse_args(argv)

    print(
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), CPU: {cpu_name()}, "
        f"{args.dtype}, random weights (load_format dummy), median of {args.num_iters} calls; "
        "~ = one call incl. compile"
    )
    print(f"{'shape':<15} {'T':>5} {'grouped (ms)':>13} {'dense (ms)':>11} {'grouped/dense':>14}")
    for name in args.shapes:
        _bench_shape(name, args)


if __name__ == "__main__":
    main()
