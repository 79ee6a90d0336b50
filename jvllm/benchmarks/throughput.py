"""Offline throughput: jvllm vs HF transformers `generate` on the same model, prompts and lengths.

    python -m jvllm.benchmarks.throughput --num-prompts 64 --input-len 128 --output-len 128 \
        --dtype float32

Prompts are random token ids (like vLLM's random dataset), generation is greedy (or sampled with
--temperature/--top-p/--top-k, in both engines) with ignore_eos so both engines produce exactly
output-len tokens per prompt. With --random-range-ratio R (vLLM's name) prompt lengths are drawn
uniformly from [input-len * (1 - R), input-len * (1 + R)]; HF then gets them left-padded.
Figures are medians over --num-iters. With --num-scheduler-steps K > 1 or --async-scheduling,
jvllm runs twice, as it is (one scheduler step a model step) and then as set, and both are
printed with their ratio; --compare-quantization METHOD does the same for weights quantized
with METHOD against the model's own (or --quantization's), as two engines in one run. With
--structured json, jvllm runs the prompts with and without a JSON schema instead, with EOS
honoured (see jvllm/benchmarks/structured.py), and HF is not run. With --images-per-prompt K,
jvllm runs the prompts as text and with K images each (jvllm/benchmarks/images.py), and HF is
not run.
"""

import argparse
import gc
import json
import os
import statistics
import time

import jax

from jvllm import LLM, SamplingParams
from jvllm.attention.kv_quant import KV_CACHE_DTYPES
from jvllm.benchmarks import images, structured
from jvllm.benchmarks.workload import (
    add_workload_args,
    bench_hf,
    median_time,
    random_prompts,
    require_hf,
)
from jvllm.distributed.mesh import ensure_cpu_devices
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.data_parallel import replicas
from jvllm.model_loader.default_model import default_model_dir
from jvllm.model_loader.loader import resolve_quantization
from jvllm.quantization import QUANTIZATION_METHODS


def _timed_generate(llm: LLM, prompts, params, num_iters: int) -> tuple[float, float, float]:
    """Medians over num_iters generates of (wall, dispatch, device wait) seconds; the last two
    are the model runner's counters (ModelRunner.dispatch_seconds, device_wait_seconds)."""
    runners = [replica.model_runner for replica in replicas(llm.llm_engine)]
    walls, dispatches, waits = [], [], []
    for _ in range(num_iters):
        dispatch = sum(r.dispatch_seconds for r in runners)
        wait = sum(r.device_wait_seconds for r in runners)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        dispatches.append(sum(r.dispatch_seconds for r in runners) - dispatch)
        waits.append(sum(r.device_wait_seconds for r in runners) - wait)
    return statistics.median(walls), statistics.median(dispatches), statistics.median(waits)


def _make_llm(args, **settings) -> LLM:
    """The benchmark's engine for the workload's options, with `settings` on top."""
    options = {
        "dtype": args.dtype,
        "load_format": args.load_format,
        "max_num_seqs": max(args.num_prompts, 8),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "attention_backend": args.attention_backend,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "compile_all_buckets": True,  # no compile inside the timed runs
    }
    return LLM(args.model, **(options | settings))


def _sampling_params(args, ignore_eos: bool = True) -> SamplingParams:
    """The timed requests' sampling: greedy, or seeded with the sampling options."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=0 if args.temperature > 0 else None,
        max_tokens=args.output_len,
        ignore_eos=ignore_eos,
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def bench_jvllm(args, prompt_sets, setting: dict) -> dict:
    """One engine of the workload with `setting` (EngineArgs fields) on top, timed."""
    start = time.perf_counter()
    llm = _make_llm(args, **setting)
    startup = time.perf_counter() - start
    engine = llm.llm_engine
    runners = [replica.model_runner for replica in replicas(engine)]
    params = _sampling_params(args)
    # The same prompt for both: its prefill is cached after the first call, so the difference
    # is 64 decode steps.
    one = prompt_sets[0][:1]
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    llm.generate(
        [[1] * args.input_len],
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )  # first call: page-in of the executables
    if any(runner.sampler_plans for runner in runners):
        # A sampler plan's executables compile in the background on its first steps (a GPU's
        # default, sample/plan.py): the timed requests once, untimed, and wait for them.
        llm.generate(prompt_sets[0], params, use_tqdm=False)
        llm.generate(one, long, use_tqdm=False)
        for runner in runners:
            runner.compiler.wait_for_compiles()
    elapsed = median_time(
        lambda i: llm.generate(prompt_sets[i], params, use_tqdm=False), args.num_iters
    )
    step = [
        (t_long - t_short) / 64
        for t_long, t_short in zip(
            _timed_generate(llm, one, long, args.num_iters),
            _timed_generate(llm, one, short, args.num_iters),
            strict=True,
        )
    ]  # seconds a decode step: wall, calling the executable, waiting for the device
    return {
        "tok_s": args.num_prompts * args.output_len / elapsed,
        "elapsed": elapsed,
        "startup": startup,
        "load": sum(replica.worker.load_seconds for replica in replicas(engine)),
        "compile": sum(r.compiler.compile_seconds for r in runners),
        "warmup": sum(r.warmup_seconds for r in runners),
        "num_compilations": sum(r.compiler.num_compilations for r in runners),
        "batch1_decode_tok_s": 1 / step[0],
        "batch1_step_split_ms": (1e3 * step[1], 1e3 * step[2], 1e3 * (step[0] - step[1] - step[2])),
        "vocab_size": engine.model_config.vocab_size,
    }


# The engine as the workload sets it: what a compared setting is measured against.
_BASELINE = {
    "num_scheduler_steps": 1,
    "async_scheduling": False,
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
}


def _setting_name(setting: dict, args) -> str:
    """e.g. "[k=16, async, T=2]"; the weights too when a run compares quantizations."""
    tp, dp = setting["tensor_parallel_size"], setting["data_parallel_size"]
    parts = [f"k={setting['num_scheduler_steps']}"]
    parts += ["async"] if setting["async_scheduling"] else []
    parts += ([f"T={tp}"] if tp > 1 else []) + ([f"D={dp}"] if dp > 1 else [])
    if args.compare_quantization:
        parts.append(f"{setting.get('quantization', args.quantization) or args.dtype} weights")
    return f"[{', '.join(parts)}]"


def _print_jvllm(label: str, ours: dict) -> None:
    print(f"{label}: {ours['tok_s']:.1f} output tok/s ({ours['elapsed']:.2f}s)")
    print(
        f"{label} start-up: {ours['startup']:.1f}s (load {ours['load']:.1f}s, compile "
        f"{ours['compile']:.1f}s for {ours['num_compilations']} executables, waiting for warm-up "
        f"runs {ours['warmup']:.1f}s)"
    )
    dispatch, wait, engine = ours["batch1_step_split_ms"]
    print(
        f"{label} batch-1 decode: {ours['batch1_decode_tok_s']:.1f} tok/s; a step "
        f"{1e3 / ours['batch1_decode_tok_s']:.2f} ms: calling the model {dispatch:.2f} ms, "
        f"waiting for the device {wait:.2f} ms, the engine around them {engine:.2f} ms"
    )


def _print_workload(args, ignore_eos: bool) -> None:
    compared = args.compare_quantization is not None  # then each engine's label names its weights
    extras = [
        f"{name}={getattr(args, name)}"
        for name, off in (
            ("temperature", 0.0),
            ("top_p", 1.0),
            ("top_k", 0),
            ("logprobs", None),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        )
        if getattr(args, name) != off
    ]
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len}"
        + (f" (+-{args.random_range_ratio:.0%})" if args.random_range_ratio else "")
        + f" in x {args.output_len} out, "
        f"{'sampled' if args.temperature > 0 else 'greedy'}, "
        + ("ignore_eos, " if ignore_eos else "EOS honoured, ")
        + f"{args.dtype}, "
        + (f"{args.quantization} weights, " if args.quantization and not compared else "")
        + (f"KV cache {args.kv_cache_dtype}, " if args.kv_cache_dtype != "auto" else "")
        + ("random weights (load_format dummy), " if args.load_format == "dummy" else "")
        + f"median of {args.num_iters}"
        + (f", {', '.join(extras)}" if extras else "")
    )
    print(f"device: {jax.devices()[0].device_kind}")


def main(argv=None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="jvllm's weights kept quantized (HF runs the --dtype weights)",
    )
    parser.add_argument(
        "--compare-quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="also run jvllm with its weights quantized this way, against --quantization's "
        "(default: the --dtype weights)",
    )
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="K > 1: also run jvllm with K model steps per scheduler step, against K = 1",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="also run jvllm with asynchronous scheduling, against it off",
    )
    for name in ("--tensor-parallel-size", "--data-parallel-size"):
        parser.add_argument(
            name,
            type=int,
            default=1,
            help="> 1: also run jvllm over a device mesh, against one device (on a CPU, fake "
            "devices that share its cores: the figure says little)",
        )
    # Sampling features whose cost to measure (off by default: the plain greedy path).
    parser.add_argument(
        "--images-per-prompt",
        type=int,
        default=0,
        help="run the prompts as text and with this many images each (a model that takes "
        "images; without --model a LLaVA-1.5 shape with random weights)",
    )
    parser.add_argument("--unique-images", type=int, default=0, help="0: every image new")
    parser.add_argument("--image-size", type=int, default=336, help="pixels a side")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument(
        "--structured",
        choices=sorted(structured.CHOICES),
        default=None,
        help="run jvllm with and without this constraint (a small JSON schema) on one engine, "
        "EOS honoured, instead of against HF",
    )
    parser.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="with --structured: compact JSON (no free whitespace between its tokens)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    chosen = {name: getattr(args, name) for name in _BASELINE}
    if args.compare_quantization:
        if chosen != _BASELINE:  # one change at a time, or the ratio mixes two
            parser.error(
                "--compare-quantization compares weights alone; run it without "
                "--num-scheduler-steps, --async-scheduling and the parallel sizes"
            )
        if args.compare_quantization == args.quantization:
            parser.error(f"--compare-quantization {args.quantization} is --quantization's too")
        chosen["quantization"] = args.compare_quantization
    try:  # the engine's own checks of the setting, before the minutes of the baseline's run
        workload = {"quantization": args.quantization, "load_format": args.load_format}
        EngineArgs(**(workload | chosen))
        resolve_quantization(args.model, args.dtype, chosen.get("quantization"))
    except ValueError as e:
        parser.error(str(e))
    if args.structured and chosen != _BASELINE:
        parser.error(
            "--structured compares one engine with and without a schema; run it without "
            "--num-scheduler-steps, --async-scheduling, --compare-quantization and the "
            "parallel sizes"
        )
    if args.disable_any_whitespace and not args.structured:
        parser.error("--disable-any-whitespace applies to --structured alone")
    if args.images_per_prompt and (args.structured or chosen != _BASELINE):
        parser.error("--images-per-prompt runs one engine: leave out the other comparisons")
    ensure_cpu_devices(args.tensor_parallel_size * args.data_parallel_size)
    if args.images_per_prompt:
        args.model, args.load_format = images.model_dir(args)
    elif args.structured:
        structured.require_jsonschema()
    elif not args.skip_hf:
        require_hf()

    # The vocabulary size is needed before any engine exists; read it from the model's config.
    with open(os.path.join(args.model or default_model_dir(), "config.json")) as f:
        config = json.load(f)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]  # a VLM's: nested
    # Fresh prompts for every timed iteration: repeating them would let jvllm's prefix cache
    # skip most of the prefill (HF has none).
    prompt_sets = [
        random_prompts(
            args.num_prompts, args.input_len, vocab, args.seed + i, args.random_range_ratio
        )
        for i in range(args.num_iters)
    ]
    if args.images_per_prompt:
        llm = _make_llm(args)
        results = images.bench_images(llm, prompt_sets, _sampling_params(args), args)
        _print_workload(args, ignore_eos=True)
        images.print_images(results, args)
        return
    if args.structured:
        # Each prompt set runs twice on the engine: its second run must not find the prefixes.
        llm = _make_llm(args, enable_prefix_caching=False)
        schema, compact = structured.CHOICES[args.structured], args.disable_any_whitespace
        params = _sampling_params(args, ignore_eos=False)
        results = structured.bench_structured(llm, prompt_sets, params, schema, compact)
        _print_workload(args, ignore_eos=False)
        print(f"constraint: {'compact ' if compact else ''}JSON of {json.dumps(schema)}")
        structured.print_structured(results)
        return
    # The engine as it is, then (when set) with the chosen setting, each on its own engine.
    settings = [_BASELINE] + ([chosen] if chosen != _BASELINE else [])
    runs = []
    for setting in settings:
        runs.append((_setting_name(setting, args), bench_jvllm(args, prompt_sets, setting)))
        # The engine's reference cycles would keep its weights and KV cache on the device while
        # the next setting's engine loads (an 8B model's twice over on a GPU).
        gc.collect()
    _print_workload(args, ignore_eos=True)
    is_comparison = len(runs) > 1
    for name, ours in runs:
        _print_jvllm(f"jvllm {name}" if is_comparison else "jvllm", ours)
    if is_comparison:
        (base_name, base), (name, ours) = runs
        print(
            f"jvllm {name} / jvllm {base_name}: throughput {ours['tok_s'] / base['tok_s']:.2f}x, "
            f"batch-1 decode {ours['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:.2f}x"
        )
    if not args.skip_hf:
        sampling = (
            {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
            if args.temperature > 0
            else None
        )
        theirs = bench_hf(args, prompt_sets, sampling)
        print(
            f"HF transformers generate: {theirs['tok_s']:.1f} output tok/s ({theirs['elapsed']:.2f}s)"
        )
        ratios = [
            f"{ours['tok_s'] / theirs['tok_s']:.2f}x" + (f" {name}" if is_comparison else "")
            for name, ours in runs
        ]
        print(f"ratio jvllm / HF: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
