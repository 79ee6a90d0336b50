"""The KV a long prompt holds with hybrid KV groups (windowed layers keep their window's pages)
against every page kept (`disable_hybrid_kv_cache_manager`), Gemma 3 and Gemma 2 shapes.

    python -m jvllm.benchmarks.kv_groups                      # 32k prompt: paper, then engine
    python -m jvllm.benchmarks.kv_groups --input-len 8192 --num-layers 6

1. Paper: the engine's own KV cache manager (core/kv_cache_manager.py) takes a prompt of
   --input-len tokens in chunks of --max-num-batched-tokens, then its first decode step, for
   Gemma 3 27B (62 layers, a 1024-token window on 5 layers of 6), Gemma 2 9B (a 4096-token
   window on alternate layers) and Mistral 7B v0.1 (a 4096-token window on every layer; a
   request without penalties), bfloat16: the blocks it then holds, times a block's bytes.
2. Engine: two engines on Gemma 3's layer pattern and window with --num-layers layers and
   narrow widths (random weights), the same prompt: the KV bytes held once it is prefilled,
   read from the engine's pool, and the seconds the prefill took.
"""

import argparse
import dataclasses
import os
import time

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.workload import random_prompts
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.kv_groups import kv_cache_groups
from jvllm.core.request import Request
from jvllm.model_loader.hf import read_hf_config
from jvllm.sampling_params import SamplingParams as Params
from jvllm.worker.kv_budget import kv_bytes_per_block
from jvllm.worker.kv_layout import kv_cache_spec

CONFIGS = os.path.join(os.path.dirname(__file__), "model_configs")
MODELS = ("gemma-3-27b", "gemma-2-9b", "mistral-7b-v0.1")
MODES = ("hybrid", "every page")


def held_bytes_on_paper(model: str, input_len: int, chunk: int, block_size: int) -> dict:
    """Bytes the manager holds for one prompt after its prefill and first decode step, per
    mode, at the model's real shapes in bfloat16."""
    config = read_hf_config(os.path.join(CONFIGS, model), "bfloat16", None)
    spec = kv_cache_spec("bfloat16", "pallas")
    rows = {}
    for mode in MODES:
        groups = kv_cache_groups(config.layer_windows, enable=mode == "hybrid")
        num_blocks = 2 * -(-input_len // block_size) * groups.num_groups + 2
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, groups=groups)
        request = Request("r", list(range(input_len)), Params(), eos_token_id=None)  # no penalties
        while request.num_computed_tokens < input_len:
            n = min(chunk, input_len - request.num_computed_tokens)
            kv.allocate_slots(request, n)
            request.num_computed_tokens += n
        kv.allocate_slots(request, 1)
        held = kv.num_usable_blocks - kv.num_free_blocks
        per_block = kv_bytes_per_block(config, block_size, spec, groups.num_slots)
        rows[mode] = {"blocks": held, "bytes": held * per_block, "groups": groups.describe()}
    return rows


def _engine(args, mode: str) -> LLM:
    overrides = {
        "num_hidden_layers": args.num_layers,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "vocab_size": 4096,
    }
    return LLM(
        os.path.join(CONFIGS, "gemma-3-27b"),
        load_format="dummy",
        dtype="bfloat16",
        hf_overrides=overrides,
        skip_tokenizer_init=True,
        max_model_len=args.input_len + 16,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        disable_hybrid_kv_cache_manager=mode != "hybrid",
        seed=args.seed,
    )


def held_bytes_in_the_engine(llm: LLM, prompt: list[int]) -> tuple[int, int, float]:
    """(KV bytes held at most while `prompt` is prefilled, held after its first decode step,
    the seconds to there)."""
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    cache = engine.worker.model_runner.kv_cache
    bytes_per_block = sum(a.nbytes for a in _arrays(cache)) // kv.num_blocks
    engine.add_request("prompt", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3))
    start = time.perf_counter()
    most = 0
    while engine.scheduler.requests["prompt"].num_output_tokens < 2:
        engine.step()
        held = kv.num_usable_blocks - kv.num_free_blocks
        most = max(most, held)
    seconds = time.perf_counter() - start
    engine.abort_request(["prompt"])
    return most * bytes_per_block, held * bytes_per_block, seconds


def _arrays(cache):
    if dataclasses.is_dataclass(cache):
        return [getattr(cache, f.name) for f in dataclasses.fields(cache)]
    return [cache]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paper-only", action="store_true")
    args = parser.parse_args(argv)
    print(f"one prompt of {args.input_len} tokens, chunks of {args.max_num_batched_tokens}")
    for model in MODELS:
        rows = held_bytes_on_paper(
            model, args.input_len, args.max_num_batched_tokens, args.block_size
        )
        hybrid, kept = rows["hybrid"]["bytes"], rows["every page"]["bytes"]
        print(
            f"paper {model} ({rows['hybrid']['groups']}): hybrid {hybrid / 2**30:.2f} GiB, "
            f"every page {kept / 2**30:.2f} GiB, ratio {kept / hybrid:.2f}x"
        )
    if args.paper_only:
        return
    (prompt,) = random_prompts(1, args.input_len, 4096, args.seed)
    figures = {}
    for mode in MODES:
        figures[mode] = most, after, seconds = held_bytes_in_the_engine(_engine(args, mode), prompt)
        print(
            f"engine {mode}: {most / 2**20:.1f} MiB held at most in the prefill, "
            f"{after / 2**20:.1f} MiB after the first decode step; {seconds:.1f} s to there"
        )
    (most, after, _), (kept_most, kept_after, _) = figures["hybrid"], figures["every page"]
    print(
        f"engine ratio (every page / hybrid): {kept_most / most:.2f}x at most, "
        f"{kept_after / after:.2f}x after the prefill"
    )


if __name__ == "__main__":
    main()
