"""MLA's latent KV cache against the decompressed one (JVLLM_MLA_DISABLE=1), DeepSeek-V3 shapes.

    python -m jvllm.benchmarks.mla                    # capacity, then decode tok/s on CPU
    python -m jvllm.benchmarks.mla --num-prompts 8 --input-len 1024 --output-len 32

1. Capacity: the bytes a cached token takes at DeepSeek-V3's 61 layers (model_configs/
   deepseek-v3), latent against decompressed, and the tokens each holds in an H200's 141 GB;
   then two engines with --kv-cache-gib of KV memory on the benchmark's few layers, and the
   tokens each actually allocated.
2. Decode: both engines on the same random prompts (greedy, ignore_eos); decode tok/s is the
   output tokens after the first over the time past a one-token run of the same prompts
   (medians of --num-iters), whose own time is printed as the prefill's. The attention is DeepSeek-V3's (hidden 7168, 128 heads, q latent
   1536, KV latent 512, rope 64, nope 128, value 128); the layers (--num-layers, one dense then
   MoE), the experts (8, 4 a token), the MLP widths and the vocabulary are shrunk, the same in
   both engines, so that a CPU runs it: the figure is the cache's share of a step, not the
   real model's speed. Random weights (load_format dummy), bfloat16.
"""

import argparse
import contextlib
import os
import statistics
import time

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.workload import random_prompts
from jvllm.model_loader.hf import read_hf_config
from jvllm.models.deepseek import MLA_DISABLE_ENV
from jvllm.worker.kv_budget import kv_bytes_per_block
from jvllm.worker.kv_layout import kv_cache_spec

MODEL_DIR = os.path.join(os.path.dirname(__file__), "model_configs", "deepseek-v3")
H200_BYTES = 141e9
PATHS = ("latent", "decompressed")


@contextlib.contextmanager
def _path(name: str):
    """The engines and configs built inside read the cache layout `name`."""
    before = os.environ.get(MLA_DISABLE_ENV)
    os.environ[MLA_DISABLE_ENV] = "1" if name == "decompressed" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[MLA_DISABLE_ENV]
        else:
            os.environ[MLA_DISABLE_ENV] = before


def shrunk_overrides(num_layers: int) -> dict:
    """hf_overrides: the attention as DeepSeek-V3's, the rest small (see the docstring)."""
    return {
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 1,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "vocab_size": 4096,
    }


def capacity_of_the_real_model() -> dict:
    """Bytes a token at 61 layers, bfloat16, and the tokens an H200's memory holds, per path."""
    spec = kv_cache_spec("bfloat16", "pallas")
    rows = {}
    for name in PATHS:
        with _path(name):
            config = read_hf_config(MODEL_DIR, "bfloat16", None)
        per_token = kv_bytes_per_block(config, 1, spec)
        rows[name] = {"bytes_per_token": per_token, "h200_tokens": int(H200_BYTES // per_token)}
    return rows


def _engine(args, name: str) -> LLM:
    with _path(name):
        return LLM(
            MODEL_DIR,
            load_format="dummy",
            dtype="bfloat16",
            hf_overrides=shrunk_overrides(args.num_layers),
            skip_tokenizer_init=True,
            max_model_len=args.input_len + args.output_len + 16,
            max_num_seqs=256,  # not the capacity's cap: 256 full requests hold more than it
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
            seed=args.seed,
        )


def _cached_tokens(llm: LLM) -> int:
    cache = llm.llm_engine.worker.model_runner.kv_cache  # [L, V, K, P, B, H]
    return (cache.shape[3] - 1) * cache.shape[4]  # the null block holds none


def _prefill_s_and_decode_tok_s(llm: LLM, prompts, args) -> tuple[float, float]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def timed(params) -> float:
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(full)  # compiles every bucket the runs use
    prefill = statistics.median(timed(one) for _ in range(args.num_iters))
    whole = statistics.median(timed(full) for _ in range(args.num_iters))
    return prefill, len(prompts) * (args.output_len - 1) / (whole - prefill)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-decode", action="store_true", help="capacity only")
    args = parser.parse_args(argv)

    real = capacity_of_the_real_model()
    print("DeepSeek-V3 (61 layers, bfloat16 cache):")
    for name, row in real.items():
        print(
            f"  {name:>12}: {row['bytes_per_token']:>9,} bytes a token, "
            f"{row['h200_tokens']:>11,} tokens in 141 GB"
        )
    ratio = real["decompressed"]["bytes_per_token"] / real["latent"]["bytes_per_token"]
    print(f"  latent / decompressed capacity: {ratio:.1f}x")

    prompts = random_prompts(args.num_prompts, args.input_len, 4096, args.seed)
    figures = {}
    for name in PATHS:
        llm = _engine(args, name)
        figures[name] = {"tokens": _cached_tokens(llm)}
        if not args.skip_decode:
            timings = _prefill_s_and_decode_tok_s(llm, prompts, args)
            figures[name]["prefill_s"], figures[name]["tok_s"] = timings
        del llm
    print(
        f"engines of {args.num_layers} layers, {args.kv_cache_gib} GiB of KV: latent "
        f"{figures['latent']['tokens']:,} tokens, decompressed "
        f"{figures['decompressed']['tokens']:,} "
        f"({figures['latent']['tokens'] / figures['decompressed']['tokens']:.1f}x)"
    )
    if not args.skip_decode:
        latent, decompressed = figures["latent"]["tok_s"], figures["decompressed"]["tok_s"]
        print(
            f"decode, {args.num_prompts} x {args.input_len} -> {args.output_len}: latent "
            f"{latent:.1f} tok/s, decompressed {decompressed:.1f} tok/s "
            f"({latent / decompressed:.2f}x); prefill (the one-token run) latent "
            f"{figures['latent']['prefill_s']:.2f} s, decompressed "
            f"{figures['decompressed']['prefill_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
