"""Batch-1 decode of the default model as pre-quantized W4A16 and FP8 checkpoints against its
bfloat16 weights and its packed GGUF (Q4_1), in one run; and the weight bytes each keeps
resident against its checkpoint's tensor bytes.

    python -m jvllm.benchmarks.prequantized --output-len 128 --num-iters 3

The checkpoints are made once from the default model's float weights with
quantized_checkpoints.py and kept in --work-dir: W4A16 as llmcompressor's preset writes it
(compressed-tensors, symmetric int4 in groups of --group-size), FP8 as Qwen3-*-FP8 and
DeepSeek-V3 ship (e4m3 in blocks of 128 x 128, float32 scales). Every engine runs in bfloat16
on the same random prompt, greedy with ignore_eos; tok/s is output tokens over the median
generate time.
"""

import argparse
import glob
import os

import jax
import torch

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.quantized_checkpoints import quantize_checkpoint
from jvllm.benchmarks.workload import median_time, random_prompts
from jvllm.model_loader.default_model import default_model_dir, resolve_default_model
from jvllm.model_loader.safetensors_file import read_safetensors
from jvllm.quantization import is_quantized


def make_w4a16(work_dir: str, group_size: int) -> str:
    """The default model as compressed-tensors W4A16 in `work_dir` (made on first use)."""
    path = os.path.join(work_dir, f"smollm2-135m-w4a16-g{group_size}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        quantize_checkpoint(
            default_model_dir(),
            path,
            "compressed-tensors",
            float_dtype=torch.bfloat16,  # as llmcompressor saves a bfloat16 model
            scheme="W4A16",
            group_size=group_size,
        )
    return path


def make_fp8_blocks(work_dir: str) -> str:
    """The default model as an FP8 checkpoint of 128 x 128 blocks in `work_dir` (made on first
    use)."""
    path = os.path.join(work_dir, "smollm2-135m-fp8-block128")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        quantize_checkpoint(default_model_dir(), path, "fp8", float_dtype=torch.bfloat16)
    return path


def checkpoint_bytes(path: str) -> int:
    """The bytes of a checkpoint's tensors (a .gguf file's size)."""
    if path.endswith(".gguf"):
        return os.path.getsize(path)
    files = glob.glob(os.path.join(path, "*.safetensors"))
    return sum(x.nbytes for f in files for x in read_safetensors(f).values())


def resident_bytes(llm: LLM) -> int:
    params = llm.llm_engine.model_runner.params
    return sum(x.nbytes for x in jax.tree.leaves(params, is_leaf=is_quantized))


def decode_rate(llm: LLM, prompt, sampling: SamplingParams, num_iters: int) -> float:
    """Output tokens a second of one request, median of num_iters after a warm-up."""
    generate = lambda _: llm.generate(prompt, sampling, use_tqdm=False)
    generate(None)  # compiles what a request needs
    llm.llm_engine.model_runner.compiler.wait_for_compiles()  # and what compiles beside it
    return sampling.max_tokens / median_time(generate, num_iters)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument(
        "--group-size", type=int, default=64, help="dividing 576 (SmolLM2's hidden size)"
    )
    parser.add_argument(
        "--work-dir", default=os.path.expanduser("~/.cache/jvllm/bench"), help="checkpoints"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    w4a16 = make_w4a16(args.work_dir, args.group_size)
    fp8 = make_fp8_blocks(args.work_dir)
    settings = {
        "bfloat16": ({"model": None}, default_model_dir()),
        "GGUF Q4_1 packed": ({"model": None, "quantization": "gguf"}, resolve_default_model()),
        f"W4A16 g{args.group_size}": ({"model": w4a16}, w4a16),
        "FP8 blocks 128": ({"model": fp8}, fp8),
    }
    prompt = random_prompts(1, args.input_len, 49152, seed=0)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"batch-1 decode, {args.input_len} -> {args.output_len} tokens, bfloat16 activations")
    rates = {}
    max_model_len = args.input_len + args.output_len + 16
    for name, (kwargs, source) in settings.items():
        llm = LLM(**kwargs, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=1)
        rates[name] = decode_rate(llm, prompt, sampling, args.num_iters)
        resident, stored = resident_bytes(llm), checkpoint_bytes(source)
        print(
            f"{name:>18}: {rates[name]:7.1f} tok/s; weights resident {resident / 2**20:6.1f} MiB"
            f" against {stored / 2**20:6.1f} MiB of checkpoint ({resident / stored:.2f}x)"
        )
        del llm
    bf16, gguf, *checkpoints = rates
    for name in checkpoints:
        print(
            f"{name} / {bf16}: {rates[name] / rates[bf16]:.2f}x; "
            f"{name} / {gguf}: {rates[name] / rates[gguf]:.2f}x (medians of {args.num_iters})"
        )


if __name__ == "__main__":
    main()
