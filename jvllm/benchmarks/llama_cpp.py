"""Batch-1 decode: jvllm against llama.cpp (through llama-cpp-python) on the same GGUF file.

    python -m jvllm.benchmarks.llama_cpp [--engine quantization=gguf ...] [--output-len 128]

Both run the default model's GGUF (or --model's), the same prompt token ids (the start of the
perplexity text of quality.py), greedy, with EOS ignored, on as many threads as jvllm's XLA CPU
client uses. Time to first token (the prompt's prefill) and the decode rate after it are
measured apart, from the times each token arrives; the figures are medians over --num-iters
runs after one warm-up run (jvllm compiles in it). jvllm runs as `LLM(model=gguf, **engine)`
with `--engine key=value` options passed through (prefix caching off unless set, so that each
run prefills the prompt as llama.cpp does).

The thread count is the cores this process may run on (`taskset -c 0 python -m ...` gives one
each). llama.cpp's threads spin at each step's barriers, so on cores that other work keeps busy
its multi-threaded figures fall several-fold while one thread's hold: compare on idle cores or
on one.
"""

import argparse
import gc
import os
import statistics
import time
from collections.abc import Sequence

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.quality import greedy_agreement, parse_engine_kwargs, perplexity_text
from jvllm.benchmarks.startup import cpu_name
from jvllm.model_loader.default_model import resolve_default_model

# On CPUs with AMX, llama.cpp's default (native) build crashes; these build it for AVX-512.
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
LLAMA_CPP_MISSING = (
    "llama.cpp's side of this benchmark needs llama-cpp-python (built from source, several "
    f"minutes): CMAKE_ARGS=\"{LLAMA_CPP_CMAKE_ARGS}\" pip install -e '.[bench-llama-cpp]' "
    "(those CMAKE_ARGS are needed on CPUs with AMX, where the default build crashes)"
)


def require_llama_cpp():
    """The llama_cpp module; exit with how to install it where it is missing."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(LLAMA_CPP_MISSING) from None
    return llama_cpp


def num_cpu_threads() -> int:
    """The cores this process may run on: the size of XLA's CPU thread pool."""
    return len(os.sched_getaffinity(0))


def _threads(num_threads: int) -> str:
    return f"{num_threads} thread{'s' if num_threads > 1 else ''}"


def _median_rates(runs: Sequence[tuple[float, float]], num_tokens: int) -> dict:
    """Medians of (seconds to the first token, seconds from it to the last) over the runs."""
    ttft = statistics.median(first for first, _ in runs)
    decode = statistics.median(rest for _, rest in runs)
    return {"ttft_ms": 1e3 * ttft, "decode_tok_s": (num_tokens - 1) / decode}


def bench_jvllm(gguf: str, engine_kwargs: dict, text: str, args) -> tuple[dict, list, list]:
    """jvllm's medians, from the engine's own token times (RequestMetrics), its tokens, and the
    prompt's token ids (the first --input-len of `text`, as jvllm's tokenizer reads it)."""
    kwargs = {"enable_prefix_caching": False, **engine_kwargs}
    llm = LLM(model=gguf, **kwargs)
    prompt = llm.get_tokenizer().encode(text)[: args.input_len]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for i in range(args.num_iters + 1):  # the first: compile and warm-up
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        m = output.metrics
        if i:
            runs.append(
                (m.first_token_time - m.arrival_time, m.last_token_time - m.first_token_time)
            )
    options = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    print(f"jvllm: LLM(gguf, {options}), weights in {llm.llm_engine.model_config.dtype}")
    return _median_rates(runs, args.output_len), output.outputs[0].token_ids, prompt


def bench_llama_cpp(gguf: str, prompt: list[int], num_threads: int, args) -> tuple[dict, list]:
    """llama.cpp's medians, from the times its token generator yields, and its tokens."""
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(
        model_path=gguf,
        n_ctx=len(prompt) + args.output_len + 1,
        n_threads=num_threads,
        n_threads_batch=num_threads,
        verbose=False,
    )
    runs = []
    for i in range(args.num_iters + 1):  # the first: warm-up
        llm.reset()  # prefill the prompt again, as jvllm does with prefix caching off
        token_ids, times = [], []
        start = time.perf_counter()
        for token_id in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            token_ids.append(token_id)
            if len(token_ids) == args.output_len:
                break
        if i:
            runs.append((times[0] - start, times[-1] - times[0]))
    print(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, {_threads(num_threads)}")
    return _median_rates(runs, args.output_len), token_ids


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file; default: the default model's")
    parser.add_argument(
        "--engine",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="LLM keyword arguments for jvllm (e.g. quantization=gguf)",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens")
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2: the decode rate is after the first token")
    try:
        engine_kwargs = parse_engine_kwargs(args.engine)
    except ValueError as e:
        parser.error(str(e))
    require_llama_cpp()  # before jvllm's run, not after it

    gguf = args.model or resolve_default_model()
    num_threads = num_cpu_threads()
    ours, our_tokens, prompt = bench_jvllm(gguf, engine_kwargs, perplexity_text(), args)
    gc.collect()  # free jvllm's engine (a reference cycle) before llama.cpp's run
    # The same token ids for llama.cpp: its reading of the GGUF's tokenizer cannot differ.
    theirs, their_tokens = bench_llama_cpp(gguf, prompt, num_threads, args)

    print(
        f"{os.path.basename(gguf)}, CPU: {cpu_name()}, {_threads(num_threads)}, batch 1, "
        f"{len(prompt)} prompt tokens, {args.output_len} new (greedy, EOS ignored), "
        f"median of {args.num_iters}"
    )
    for name, rates in (("jvllm", ours), ("llama.cpp", theirs)):
        print(
            f"{name}: first token {rates['ttft_ms']:.1f} ms, "
            f"decode {rates['decode_tok_s']:.1f} tok/s"
        )
    print(
        f"ratio jvllm / llama.cpp: decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x, "
        f"time to first token {ours['ttft_ms'] / theirs['ttft_ms']:.2f}x"
    )
    agreement = greedy_agreement([our_tokens], [their_tokens], args.output_len)
    print(
        f"greedy tokens equal to llama.cpp's before the first difference: "
        f"{agreement.common_prefix_lens[0]} of {args.output_len}"
    )


if __name__ == "__main__":
    main()
