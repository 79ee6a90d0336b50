"""The layer scan against the layers unrolled (the engine's previous layout), in one run.

    python -m jvllm.benchmarks.layer_scan --dtype bfloat16
    python -m jvllm.benchmarks.layer_scan --model jvllm/benchmarks/model_configs/llama-3-8b \
        --load-format dummy --dtype bfloat16        # on a GPU

For each layout, a fresh engine with the compilation cache off: the seconds to compile a decode
bucket of 1 and of --batch sequences and a mixed bucket of --prefill-tokens, then the median
decode tok/s of 1 and of --batch sequences (prompts of --input-len random tokens, --output-len
tokens each, greedy). --compile-only times the compiles alone, for weights that exist only as
shapes (a model that does not fit the machine, e.g. the 8B shapes on a small CPU host):

    python -m jvllm.benchmarks.layer_scan --model jvllm/benchmarks/model_configs/llama-3-8b \
        --compile-only "unrolled" is the model as it was before the scan: a Python loop over the
layers, each with its own weight arrays (the stacked params split per layer). The benchmark
swaps it into the step body in this process only.
"""

import argparse
import os
import statistics
import time

import jax
import numpy as np

from jvllm import LLM, SamplingParams
from jvllm.attention.backends import default_backend
from jvllm.benchmarks.throughput import random_prompts
from jvllm.model_loader.hf import read_hf_config
from jvllm.model_loader.loader import LOAD_FORMATS
from jvllm.models import llama
from jvllm.worker import step_fn
from jvllm.worker.buckets import BucketSpec
from jvllm.worker.model_runner import ModelRunner


def unrolled_forward(params, kv_cache, token_ids, positions, metadata, *, config, attn):
    """llama.forward with the layers written out; `params.layers` is a tuple of per-layer
    LayerParams (see _split_layers)."""
    x = llama._embed(params.embed, token_ids)  # [T, D]
    cos, sin = llama.rope_cos_sin(positions, config)  # [T, H] each
    for layer, lp in enumerate(params.layers):
        x, kv_cache = llama._decoder_layer(
            x, kv_cache, lp, np.int32(layer), cos, sin, metadata, config, attn
        )
    return llama.rms_norm(x, params.final_norm, config.rms_norm_eps), kv_cache


def _layer_of(w, i: int):
    """Layer i of a stacked field, an array or only its shape."""
    if isinstance(w, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
    return w[i]


def _split_layers(params: llama.Params) -> llama.Params:
    """The stacked [L, ...] fields as a tuple of L per-layer LayerParams."""
    num_layers = params.layers.qkv.shape[0]
    layers = tuple(
        jax.tree.map(lambda w, i=i: _layer_of(w, i), params.layers) for i in range(num_layers)
    )
    return llama.Params(params.embed, layers, params.final_norm, params.lm_head)


def _compile_seconds(runner: ModelRunner, args) -> dict:
    result = {}
    for name, bucket in {
        "decode 1": runner.buckets.select(1, 1),
        f"decode {args.batch}": runner.buckets.select(args.batch, args.batch),
        f"mixed {args.prefill_tokens}": runner.buckets.select(args.prefill_tokens, 2),
    }.items():
        start = time.perf_counter()
        runner._executable(bucket)
        result[f"compile {name} (s)"] = time.perf_counter() - start
    return result


def _compile_only(args, layout: str) -> dict:
    """The compile seconds of a runner whose params are only shapes (nothing runs)."""
    config = read_hf_config(args.model, args.dtype)
    params = llama.param_shapes(config)
    if layout == "unrolled":
        params = _split_layers(params)
    runner = ModelRunner(
        config,
        params,
        num_blocks=64,
        block_size=16,
        max_model_len=args.input_len + args.output_len + 16,
        buckets=BucketSpec(2048, args.batch),
        attention_backend=default_backend(),
        max_num_seqs=args.batch,
    )
    return _compile_seconds(runner, args)


def _bench_layout(args, layout: str) -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_seqs=args.batch,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,  # every run the same steps as the untimed first
    )
    runner = llm.llm_engine.model_runner
    if layout == "unrolled":
        runner.params = _split_layers(runner.params)
        runner._state_spec = runner._abstract_state()
    result = _compile_seconds(runner, args)
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for batch in (1, args.batch):
        prompts = random_prompts(batch, args.input_len, vocab, seed=0)
        llm.generate(prompts, params, use_tqdm=False)  # compiles what the buckets above lack
        runner.wait_for_compiles()  # and what it borrowed larger buckets for meanwhile
        times = []
        for _ in range(args.num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result[f"batch {batch} (tok/s)"] = batch * args.output_len / statistics.median(times)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true", help="no weights, no runs")
    args = parser.parse_args(argv)
    if args.compile_only and args.model is None:
        parser.error("--compile-only needs --model: an HF model directory (its config.json)")
    os.environ["JVLLM_COMPILATION_CACHE_DIR"] = ""  # every compile is a cold one
    jax.config.update("jax_enable_compilation_cache", False)

    scanned_forward = step_fn.forward
    results = {}
    try:
        for layout, forward in (("scan", scanned_forward), ("unrolled", unrolled_forward)):
            step_fn.forward = forward
            bench = _compile_only if args.compile_only else _bench_layout
            results[layout] = bench(args, layout)
    finally:
        step_fn.forward = scanned_forward
    print(f"\n{args.model or 'default model'} {args.dtype} on {jax.devices()[0].device_kind}")
    print(f"{'':32} {'scan':>10} {'unrolled':>10} {'scan/unrolled':>14}")
    for key in results["scan"]:
        scan, unrolled = results["scan"][key], results["unrolled"][key]
        print(f"{key:32} {scan:10.2f} {unrolled:10.2f} {scan / unrolled:13.2f}x")


if __name__ == "__main__":
    main()
