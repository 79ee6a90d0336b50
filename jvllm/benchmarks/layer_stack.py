"""A decoder stack's matmuls alone (no attention), T tokens through L Llama-shaped layers, with
the weights laid out seven ways, to see what each costs on a device:

    scan         [L, ...] stacked weights, each layer taken by a dynamic index inside lax.scan
                 behind an optimization barrier (layers/scan.py's scan on CPU)
    scan-nb      the same without the barrier
    scan-unroll  "scan" with lax.scan's unroll=True, the barrier kept
    unrolled     the same [L, ...] arrays, layers unrolled with static indices
    list         one array per layer, unrolled (layers/scan.py's unstack_layers, on a GPU)
    list-barrier "list" with each layer's weights tied to its input by an optimization
                 barrier (what would keep XLA from working on a layer's weights early)
    list-fp8     "list" with fp8 weights and per-channel scales (quantization="fp8"; on a GPU
                 an fp8 matmul of per-token fp8 activations)

Prints each layout's median time against its floor (its weight bytes over the read bandwidth of
weight_read's jitted sum) and against "scan", how long the call takes to return, and its
compile time.

    python -m jvllm.benchmarks.layer_stack --model jvllm/benchmarks/model_configs/llama-3-8b
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jvllm.benchmarks.weight_read import read_bandwidth
from jvllm.config import ModelConfig
from jvllm.model_loader.hf import read_hf_config
from jvllm.quantization.channel_weight import ChannelWeight, quantize_channels

LAYOUTS = ("scan", "scan-nb", "scan-unroll", "unrolled", "list", "list-barrier", "list-fp8")


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[in, out] of each matmul of one Llama-style decoder layer."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q": (d, q),
        "k": (d, kv),
        "v": (d, kv),
        "o": (q, d),
        "g": (d, f),
        "u": (d, f),
        "d": (f, d),
    }


def _mm(x: jax.Array, w: jax.Array | ChannelWeight) -> jax.Array:
    """x [T, in] @ a weight [in, out], or a quantized one (values [out, in]) -> [T, out]."""
    return w.dense(x).astype(x.dtype) if isinstance(w, ChannelWeight) else x @ w


def _layer(x: jax.Array, w: dict) -> jax.Array:
    """x [T, D] through one layer's matmuls; k and v feed a sum so that none is dead code."""
    h = (
        _mm(x, w["q"])
        + jnp.sum(_mm(x, w["k"]), axis=-1, keepdims=True)
        + jnp.sum(_mm(x, w["v"]), axis=-1, keepdims=True)
    )
    x = x + _mm(h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6), w["o"])
    x = x + _mm(jax.nn.silu(_mm(x, w["g"])) * _mm(x, w["u"]), w["d"])
    return x * jax.lax.rsqrt(
        jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
    ).astype(x.dtype)


def stack(layout: str, x: jax.Array, weights) -> jax.Array:
    """x [T, D] through every layer; weights: {name: [L, in, out]}, or a list of per-layer dicts."""
    if layout.startswith("list"):
        for w in weights:
            if layout == "list-barrier":
                w, x = jax.lax.optimization_barrier((w, x))
            x = _layer(x, w)
        return x
    num_layers = next(iter(weights.values())).shape[0]
    if layout == "unrolled":
        for i in range(num_layers):
            x = _layer(x, {k: v[i] for k, v in weights.items()})
        return x

    def step(x, i):
        ws = weights if layout == "scan-nb" else jax.lax.optimization_barrier((weights, i))[0]
        w = {k: jax.lax.dynamic_index_in_dim(v, i, keepdims=False) for k, v in ws.items()}
        return _layer(x, w), None

    layer_ids = jnp.arange(num_layers, dtype=jnp.int32)
    return jax.lax.scan(step, x, layer_ids, unroll=layout == "scan-unroll")[0]


def _weights(layout: str, stacked: dict, per_layer: list[dict]):
    """The weights as `layout` takes them."""
    if layout == "list-fp8":  # ChannelWeight's values are [out, in]
        return [
            {k: quantize_channels(v.T, "fp8", "bfloat16") for k, v in w.items()} for w in per_layer
        ]
    return per_layer if layout.startswith("list") else stacked


def _time(fn, x, weights, repeats: int) -> tuple[float, float]:
    """Median seconds of a call to the result being ready, and of the call returning."""
    fn(x, weights).block_until_ready()
    fn(x, weights).block_until_ready()
    total, dispatch = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(x, weights)
        dispatch.append(time.perf_counter() - start)
        out.block_until_ready()
        total.append(time.perf_counter() - start)
    return statistics.median(total), statistics.median(dispatch)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="jvllm/benchmarks/model_configs/llama-3-8b")
    parser.add_argument("--num-layers", type=int, help="default: the config's")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["scan", "list"])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    config = read_hf_config(args.model)
    num_layers = args.num_layers or config.num_layers
    stacked = {}  # name -> bfloat16[L, in, out]
    for n, (name, (i, o)) in enumerate(layer_shapes(config).items()):
        w = jax.random.normal(jax.random.key(n), (num_layers, i, o), jnp.float32) * i**-0.5
        stacked[name] = w.astype(jnp.bfloat16)
    nbytes = sum(v.nbytes for v in stacked.values())
    bandwidth = read_bandwidth(min(4 << 30, nbytes), 20)
    print(
        f"device: {jax.devices()[0].device_kind}; {num_layers} layers, {nbytes / 1e9:.2f} GB "
        f"of bfloat16 weights; read bandwidth {bandwidth / 1e9:.1f} GB/s: floor "
        f"{nbytes / bandwidth * 1e3:.3f} ms"
    )
    per_layer = [{k: v[i] + 0 for k, v in stacked.items()} for i in range(num_layers)]
    scan_seconds = {}
    for layout in args.layouts:
        weights = _weights(layout, stacked, per_layer)
        floor = sum(w.nbytes for w in jax.tree.leaves(weights)) / bandwidth
        # The benchmark's own jits, not the engine's entry points (the model runner's).
        fn = jax.jit(lambda x, w, layout=layout: stack(layout, x, w))
        for tokens in args.tokens:
            x = jax.random.normal(jax.random.key(-tokens), (tokens, config.hidden_size))
            x = x.astype(jnp.bfloat16)
            start = time.perf_counter()
            fn.lower(x, weights).compile()
            compile_s = time.perf_counter() - start
            total, dispatch = _time(fn, x, weights, args.repeats)
            if layout == "scan":
                scan_seconds[tokens] = total
            vs_scan = (
                f", {scan_seconds[tokens] / total:.2f}x scan" if tokens in scan_seconds else ""
            )
            print(
                f"{layout:12s} T={tokens:<4d} {total * 1e3:8.3f} ms ({total / floor:.2f}x floor"
                f"{vs_scan}), call returns in {dispatch * 1e3:.3f} ms, compile {compile_s:.1f} s",
                flush=True,
            )
        del weights
    x = jax.random.normal(jax.random.key(7), (4, config.hidden_size)).astype(jnp.bfloat16)
    a = jax.jit(lambda x, w: stack("scan", x, w))(x, stacked).astype(jnp.float32)
    b = jax.jit(lambda x, w: stack("list", x, w))(x, per_layer).astype(jnp.float32)
    print(
        f"scan vs list: relative difference {float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)):.1e}"
    )


if __name__ == "__main__":
    main()
