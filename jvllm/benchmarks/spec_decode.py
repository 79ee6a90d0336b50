"""Speculative decoding (n-gram drafts, a draft model, or an EAGLE-3 head) against plain
decoding, at batch 1: one request at a time, greedy and sampled (seeded, temperature 0.7 unless
--temperatures says otherwise), on a prompt whose answer repeats it (editing code) and on one
whose answer does not (a story).

    python -m jvllm.benchmarks.spec_decode                    # the default model, bfloat16
    python -m jvllm.benchmarks.spec_decode -k 5 --max-tokens 256 --temperatures 0,0.7,1
    python -m jvllm.benchmarks.spec_decode --method draft_model --draft-layers 8
    python -m jvllm.benchmarks.spec_decode --method eagle3
    python -m jvllm.benchmarks.spec_decode --method mtp
    python -m jvllm.benchmarks.spec_decode --method eagle
    python -m jvllm.benchmarks.spec_decode --method eagle3 --model DIR --load-format dummy

`--method draft_model` drafts with the target's first --draft-layers layers, its final norm and
its LM head (the same checkpoint loaded with hf_overrides={"num_hidden_layers": N}: the loader
keeps the first N layers), unless --draft-model names another model. `--method eagle3` drafts
with the EAGLE-3 head --draft-model names, else with one of random weights of the target's
shapes (benchmarks/random_heads.py; a draft vocabulary of 32000 ids): its drafts are almost
never accepted, so each round gives one token and its cost is what speculation adds; `--method
eagle` likewise with an EAGLE-1 head (its LM head the target's).
`--method mtp` drafts with the MTP layer of --model's checkpoint (a DeepSeek-V3), else both run
a small random DeepSeek-V3 that keeps one (4 layers of the default model's width, 16 experts,
its tokenizer: benchmarks/random_heads.py), whose drafts are likewise never accepted.

Prints, for each prompt and temperature, the output tok/s without and with speculation (the
same engine options otherwise), their ratio, the drafts' acceptance rate, and whether the tokens
are the same (a seeded sampled request's are, as a greedy one's, but for bfloat16's near ties);
then a round's cost (a verification of k + 1 rows, the draft's work) over a plain decode
step's, and the speed-up it implies where k drafts are each accepted at 60% and 80%: the
expected tokens a round, (1 - a^(k+1)) / (1 - a), over that cost.
With --num-scheduler-steps R > 1, a third engine runs R rounds of
speculation a device call (worker/spec_window.py): its tok/s, and its ratio to one call a round
(the speculative engine's), is what chaining rounds on the device saves.
The window's rounds are costed the same way, at the acceptance of one call a round.
Each engine runs the prompt once untimed first, so that compiles are not counted, then
--num-iters times, alternating with the other; the figures are medians.
"""

import argparse
import statistics
import tempfile
import time

import jax

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.random_heads import (
    save_random_deepseek_v3_with_mtp,
    save_random_eagle1_head,
    save_random_eagle3_head,
)
from jvllm.benchmarks.startup import cpu_name
from jvllm.model_loader.default_model import DEFAULT_MODEL, default_model_dir
from jvllm.spec_decode.config import SPECULATIVE_METHODS

_CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
"""
PROMPTS = {
    "repetitive": (
        "Rename the variable `subtotal` to `net` in this Python code and print the whole "
        f"code again.\n\n```python\n{_CODE}```\n\nHere is the code with `net`:\n\n```python\n"
    ),
    "non-repetitive": "Write a short story about a lighthouse keeper who finds a map.\n\n",
}


def timed_generate(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    """(output token ids, seconds) of one generate."""
    start = time.perf_counter()
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return list(output.outputs[0].token_ids), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="None: the default model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--method", choices=SPECULATIVE_METHODS, default="ngram")
    parser.add_argument(
        "--draft-model", default=None, help="None: the target's first layers, or a random head"
    )
    parser.add_argument("--draft-layers", type=int, default=8, help="of the derived draft")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=1, help="> 1: also R rounds a device call"
    )
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--load-format", default="auto", help="dummy: random weights of --model's config.json"
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="each engine's KV cache (on a GPU, where the first engine would take the rest)",
    )
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs; medians")
    parser.add_argument(
        "--temperatures",
        default="0,0.7",
        help="comma-separated; 0 is greedy, the others sample with seed 0",
    )
    args = parser.parse_args(argv)
    target_name = args.model or "the default model"
    if args.method == "mtp" and args.model is None:
        args.model = tempfile.mkdtemp(prefix="jvllm_deepseek_v3_mtp_")
        save_random_deepseek_v3_with_mtp(args.model, default_model_dir())
        target_name = "a random DeepSeek-V3 with an MTP layer"
    engine_kwargs = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": 8,
        "load_format": args.load_format,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
    }
    speculative_config = {
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if args.method == "ngram":
        speculative_config["prompt_lookup_max"] = args.prompt_lookup_max
        speculative_config["prompt_lookup_min"] = args.prompt_lookup_min
    elif args.draft_model is not None:
        speculative_config["model"] = args.draft_model
    elif args.method == "draft_model":
        speculative_config["model"] = args.model or DEFAULT_MODEL
        speculative_config["hf_overrides"] = {"num_hidden_layers": args.draft_layers}
    plain = LLM(args.model, **engine_kwargs)
    if args.method == "eagle3" and args.draft_model is None:
        speculative_config["model"] = head_dir = tempfile.mkdtemp(prefix="jvllm_eagle3_")
        target = plain.llm_engine.model_config
        # EAGLE-3's layers (2, L/2, L - 3), kept inside a shallow target's.
        layers = tuple(
            min(max(i, 0), target.num_layers - 1)
            for i in (2, target.num_layers // 2, target.num_layers - 3)
        )
        save_random_eagle3_head(
            head_dir, target, draft_vocab_size=min(32000, target.vocab_size), layer_ids=layers
        )
    if args.method == "eagle" and args.draft_model is None:
        speculative_config["model"] = head_dir = tempfile.mkdtemp(prefix="jvllm_eagle_")
        save_random_eagle1_head(head_dir, plain.llm_engine.model_config)
    speculative = LLM(args.model, speculative_config=speculative_config, **engine_kwargs)
    windowed = None
    if args.num_scheduler_steps > 1:
        windowed = LLM(
            args.model,
            speculative_config=speculative_config,
            num_scheduler_steps=args.num_scheduler_steps,
            **engine_kwargs,
        )
    stats = speculative.llm_engine.spec_decoding_stats
    temperatures = [float(t) for t in args.temperatures.split(",")]
    k, rounds = args.num_speculative_tokens, []
    device = jax.devices()[0].device_kind
    print(f"CPU: {cpu_name()}; device: {device}; {target_name} in {args.dtype}, batch 1")
    print(f"speculative_config: {speculative_config}, {args.max_tokens} tokens a prompt")
    window_header = "" if windowed is None else f" {'window tok/s':>12} {'/spec':>6} {'same':>5}"
    print(
        f"{'prompt':<16} {'temp':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
        f"{'accepted':>9} {'same tokens':>11}{window_header}"
    )
    for name, prompt in PROMPTS.items():
        for temperature in temperatures:
            params = SamplingParams(
                temperature=temperature, seed=0, max_tokens=args.max_tokens, ignore_eos=True
            )
            engines = [e for e in (plain, speculative, windowed) if e is not None]
            for llm in engines:
                timed_generate(llm, prompt, params)  # compiles
            drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
            times: list[list[float]] = [[] for _ in engines]
            for _ in range(args.num_iters):  # alternating, so that all see the machine's drift
                runs = [timed_generate(llm, prompt, params) for llm in engines]
                for seconds, (_, run_s) in zip(times, runs):
                    seconds.append(run_s)
            (want, _), (got, _) = runs[:2]
            plain_s, spec_s, *window_s = [statistics.median(t) for t in times]
            num_drafts = stats.num_draft_tokens - drafts
            rate = (stats.num_accepted_tokens - accepted) / num_drafts if num_drafts else 0.0
            print(
                f"{name:<16} {temperature:>4.2g} {len(want) / plain_s:>11.1f} "
                f"{len(got) / spec_s:>10.1f} {plain_s / spec_s:>5.2f}x {rate:>8.0%} "
                f"{got == want!s:>11}"
                + (
                    f" {len(runs[2][0]) / window_s[0]:>12.1f} {spec_s / window_s[0]:>5.2f}x "
                    f"{runs[2][0] == want!s:>5}"
                    if window_s
                    else ""
                )
            )
            step_s = plain_s / len(want)
            rounds.append(
                [
                    round_cost(len(run[0]), s, rate, k) / step_s
                    for run, s in zip(runs[1:], [spec_s, *window_s])
                ]
            )
    for name, costs in zip(("a round", "a round in a window"), zip(*rounds)):
        cost = statistics.median(costs)
        implied = "; ".join(f"{a:.0%}: {tokens_a_round(a, k) / cost:.2f}x" for a in (0.6, 0.8))
        print(f"{name} costs {cost:.2f} plain decode steps (median); implied speed-up at {implied}")


def tokens_a_round(acceptance: float, k: int) -> float:
    """Expected tokens a round of k drafts gives, each accepted at `acceptance` after the last."""
    return sum(acceptance**i for i in range(k + 1))


def round_cost(num_tokens: int, seconds: float, acceptance: float, k: int) -> float:
    """Seconds a round, from a run's tokens and time at its measured acceptance."""
    return seconds / (num_tokens / tokens_a_round(acceptance, k))


if __name__ == "__main__":
    main()
