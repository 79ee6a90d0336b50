"""DeepSeek-V3 on 16 devices, on paper: weights, KV and the MoE layer's traffic per device, the
layer compiled for 16 fake CPU devices at V3's shapes (nothing allocated, nothing run).

    python -m jvllm.benchmarks.moe_dispatch [--tokens-per-device 64 256]

Two layouts of the MoE layer, each jvllm's own code (layers/deepseek_moe.py, layers/moe.py)
inside shard_map over 16 devices, each device holding 16 of the 256 routed experts:
- "replicated": expert parallelism as built (distributed/expert_parallel.py): every device has
  every token (tensor-parallel attention), runs its experts' assignments, one all-reduce sums;
- "dp-attention": attention data-parallel, each device its own tokens: all-gather the tokens,
  run the held experts' assignments (and a 1/16 slice of the shared expert) on all of them,
  reduce-scatter each device's rows back (vLLM's allgather_reducescatter dispatch; the engine
  runs it with `data_parallel_size` and `enable_expert_parallel`, distributed/data_parallel_moe.py,
  whose all2all_backend "ragged_all_to_all" sends each token to its experts' devices instead);
  here the gather and scatter are written around the layer over one mesh axis of 16.
For each: the collectives in the compiled HLO with their bytes a device sends (ring algorithms:
an all-reduce sends 2(n-1)/n of its buffer, an all-gather or reduce-scatter (n-1)/n of the
gathered one); beside them the bytes an all-to-all dispatch would move (not compiled). Then the
weights and cached tokens a device holds with the model in FP8 (V3's release: every projection
1 byte with a float32 scale a 128 x 128 block; embeddings, norms, routers as they are), and the
bytes a decode step reads (every weight: at these batches nearly every expert has tokens).
"""

import argparse
import os
import re

from jvllm.distributed.mesh import ensure_cpu_devices

NUM_DEVICES = 16

if __name__ == "__main__":  # before JAX starts its backends
    ensure_cpu_devices(NUM_DEVICES)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jvllm.distributed.expert_parallel import expert_parallel_config, is_expert_stack
from jvllm.distributed.mesh import TP_AXIS, make_mesh
from jvllm.distributed.tensor_parallel import shard_config
from jvllm.layers.deepseek_moe import DeepseekMoE
from jvllm.model_loader.hf import read_hf_config
from jvllm.models.model import param_axes, param_shapes
from jvllm.worker.kv_budget import kv_bytes_per_block
from jvllm.worker.kv_layout import kv_cache_spec

MODEL_DIR = os.path.join(os.path.dirname(__file__), "model_configs", "deepseek-v3")
HBM_BYTES = 141e9  # an H200's memory
HBM_READ = 4.8e12  # and its read bandwidth, bytes a second
FP8_BLOCK = 128 * 128  # weights a float32 scale covers in V3's FP8 release
# Params V3's FP8 release keeps in their own dtype (by path): the rest are projections.
_UNQUANTIZED = ("embed", "lm_head", "router", "norm", "correction_bias")
_HLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f8e4m3fn": 1, "s8": 1, "pred": 1}
_COLLECTIVE = re.compile(
    r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|all-to-all)"
)


def weights_per_device(config) -> tuple[float, float]:
    """(bytes of the weights every device holds, bytes of its 1/16 of the routed experts), FP8."""
    shapes = jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]
    axes = jax.tree.leaves(param_axes(config), is_leaf=lambda x: isinstance(x, tuple))
    replicated = experts = 0.0
    for (path, shape), names in zip(shapes, axes):
        key = jax.tree_util.keystr(path)
        size = float(np.prod(shape.shape))
        if any(word in key for word in _UNQUANTIZED):
            nbytes = size * shape.dtype.itemsize
        else:
            nbytes = size + size / FP8_BLOCK * 4
        if is_expert_stack(names):
            experts += nbytes / NUM_DEVICES
        else:
            replicated += nbytes
    return replicated, experts


def _stacked(local: jax.ShapeDtypeStruct, mesh) -> jax.ShapeDtypeStruct:
    """A device's array as one [16, ...] array cut on its first axis."""
    sharding = NamedSharding(mesh, PartitionSpec(TP_AXIS))
    return jax.ShapeDtypeStruct((NUM_DEVICES, *local.shape), local.dtype, sharding=sharding)


def compile_layer(config, layout: str, tokens_per_device: int, mesh):
    """The compiled MoE layer of `layout` for `tokens_per_device` tokens a device."""
    local = shard_config(expert_parallel_config(config, NUM_DEVICES, True), NUM_DEVICES)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekMoE(local)))
    num_tokens = tokens_per_device * (NUM_DEVICES if layout == "replicated" else 1)
    x = jax.ShapeDtypeStruct((num_tokens, config.hidden_size), jnp.float32)

    def layer(state, x):  # per device, its arrays without the leading axis
        state, x = jax.tree.map(lambda a: a[0], (state, x))
        if layout == "replicated":
            return nnx.merge(graphdef, state)(x)[None]
        everyone = jax.lax.all_gather(x, TP_AXIS, tiled=True)  # [16 t, D]
        # The module's closing all-reduce, split: a reduce-scatter of each device's rows.
        module = nnx.merge(graphdef, state)
        module.num_shards = 1  # its partial sum, which the reduce-scatter adds up
        out = module(everyone)
        return jax.lax.psum_scatter(out, TP_AXIS, scatter_dimension=0, tiled=True)[None]

    spec = PartitionSpec(TP_AXIS)
    mapped = jax.shard_map(layer, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
    args = jax.tree.map(lambda a: _stacked(a, mesh), (state, x))
    return jax.jit(mapped).lower(*args).compile()


def collective_bytes(compiled) -> list[tuple[str, float]]:
    """(kind, bytes a device sends) of each collective in the compiled HLO."""
    n = NUM_DEVICES
    found = []
    for dtype, dims, kind in _COLLECTIVE.findall(compiled.as_text()):
        size = np.prod([int(d) for d in dims.split(",") if d]) * _HLO_BYTES[dtype]
        if kind == "all-reduce":
            sent = 2 * (n - 1) / n * size
        elif kind == "reduce-scatter":
            sent = (n - 1) * size  # its result is 1/n of the buffer
        else:
            sent = (n - 1) / n * size
        found.append((kind, float(sent)))
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-device", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args(argv)
    config = read_hf_config(MODEL_DIR, "bfloat16")
    num_moe = config.num_layers - config.option("first_k_dense_replace")
    replicated, experts = weights_per_device(config)
    kv_token = kv_bytes_per_block(config, 1, kv_cache_spec("bfloat16", "pallas"))
    free = HBM_BYTES - replicated - experts
    print(
        f"DeepSeek-V3, FP8, {NUM_DEVICES} devices: weights a device {replicated / 1e9:.1f} GB "
        f"held by every device + {experts / 1e9:.1f} GB of experts = "
        f"{(replicated + experts) / 1e9:.1f} GB; KV {kv_token:,} bytes a token (latent, "
        f"bfloat16): {free / kv_token:,.0f} tokens in the {free / 1e9:.1f} GB left of 141 GB"
    )
    mesh = make_mesh(1, NUM_DEVICES)
    for tokens in args.tokens_per_device:
        for layout in ("replicated", "dp-attention"):
            sent = collective_bytes(compile_layer(config, layout, tokens, mesh))
            kinds = ", ".join(sorted({kind for kind, _ in sent}))
            per_layer = sum(b for _, b in sent)
            print(
                f"{layout:>12}, {tokens} tokens a device: {kinds} (float32 partial sums); "
                f"{per_layer / 1e6:.2f} MB sent a device a layer, "
                f"{per_layer * num_moe / 1e9:.2f} GB a step over {num_moe} MoE layers"
            )
        # Each token to its k experts' devices and back, bfloat16, the 1/16 held here staying.
        k, d = config.num_experts_per_tok, config.hidden_size
        all_to_all = 2 * tokens * k * d * 2 * (NUM_DEVICES - 1) / NUM_DEVICES
        print(
            f"  all-to-all (not compiled: the bytes it would move), {tokens} tokens a device: "
            f"{all_to_all / 1e6:.2f} MB a layer, {all_to_all * num_moe / 1e9:.2f} GB a step"
        )
        reads = replicated + experts + tokens * args.context * kv_token
        print(
            f"  a decode step's reads a device at {args.context} tokens of context: "
            f"{reads / 1e9:.1f} GB, {reads / HBM_READ * 1e3:.1f} ms at 4.8 TB/s"
        )


if __name__ == "__main__":
    main()
