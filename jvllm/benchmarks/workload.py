"""The workload the offline benchmarks share (random token prompts, their options, median
timing) and its peer, HF transformers `generate` on the same prompts."""

import argparse
import os
import statistics
import time

import numpy as np

from jvllm.model_loader.default_model import default_model_dir
from jvllm.model_loader.loader import LOAD_FORMATS

HF_MISSING = (
    "HF transformers' side of this benchmark needs torch, which is not installed here (or is "
    "older than transformers takes): `pip install -e '.[test]'` installs it; or pass --skip-hf "
    "to run jvllm alone"
)


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int, range_ratio: float = 0.0
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Stay clear of the special tokens at either end of the vocabulary.
    if not range_ratio:  # the same prompts as before the option existed, for comparisons
        return rng.integers(100, vocab_size - 100, size=(num_prompts, input_len)).tolist()
    low = max(1, int(input_len * (1 - range_ratio)))
    lengths = rng.integers(low, int(input_len * (1 + range_ratio)) + 1, size=num_prompts)
    return [rng.integers(100, vocab_size - 100, size=int(n)).tolist() for n in lengths]


def median_time(fn, num_iters: int) -> float:
    """Median wall time of fn(i) for i in range(num_iters)."""
    times = []
    for i in range(num_iters):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The options throughput and dense_bound share: all that bench_hf reads."""
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="dummy: random weights from the model directory's config.json alone (both engines)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens a step at most"
    )
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")


def hf_available() -> bool:
    """Whether HF transformers can run its torch models here (torch, at a version it takes)."""
    from transformers.utils import is_torch_available

    return is_torch_available()


def require_hf() -> None:
    """Exit at once, not after jvllm's run, when HF `generate` cannot run here."""
    if not hf_available():
        raise SystemExit(HF_MISSING)


def bench_hf(args, prompt_sets, sampling: dict | None = None) -> dict:
    """HF transformers `generate` on the workload of the options add_workload_args defines;
    greedy, or sampled with sampling's temperature, top_p and top_k."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.model or default_model_dir()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if args.load_format == "dummy":  # random weights too: the same work per token
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device(device):  # drawn where it runs: an 8B model draws in seconds on a GPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()

    def run(i):
        prompts = prompt_sets[i]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
        )  # left-padded
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=sampling is not None,
                **(sampling or {}),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                pad_token_id=0,
            )
        assert out.shape[1] == width + args.output_len
        if device == "cuda":
            torch.cuda.synchronize()

    elapsed = median_time(run, args.num_iters)
    return {"tok_s": args.num_prompts * args.output_len / elapsed, "elapsed": elapsed}


if __name__ == "__main__":
    raise SystemExit(
        "workload.py is what the offline benchmarks share; run one of them, e.g. "
        "python -m jvllm.benchmarks.throughput --help"
    )
