"""What serving through LoRA adapters costs: the same workload on the base model, and on an
engine with enable_lora whose every request runs one of --num-adapters random adapters (rank
--lora-rank on q, k, v, o, gate, up and down, as PEFT writes them), in one run.

    python -m jvllm.benchmarks.lora --dtype bfloat16                # 64 x 128 -> 128
    python -m jvllm.benchmarks.lora --num-adapters 4 --lora-rank 16

Prints, for each engine, the batch-1 decode tok/s (the difference of a 65- and a 1-token
request on a cached prompt, over 64 steps) and the workload's output tok/s (median of
--num-iters), and the LoRA engine's ratio to the base model's.
"""

import argparse
import gc
import json
import os
import platform
import tempfile

import numpy as np

from jvllm import LLM, SamplingParams
from jvllm.benchmarks.startup import cpu_name
from jvllm.benchmarks.workload import median_time, random_prompts
from jvllm.lora.request import LoRARequest
from jvllm.model_loader.default_model import default_model_dir
from jvllm.model_loader.safetensors_file import write_float32_safetensors

_TARGETS = {  # PEFT's module name -> (rows, columns) of its weight, from config.json
    "self_attn.q_proj": lambda c, h: (c["num_attention_heads"] * h, c["hidden_size"]),
    "self_attn.k_proj": lambda c, h: (c["num_key_value_heads"] * h, c["hidden_size"]),
    "self_attn.v_proj": lambda c, h: (c["num_key_value_heads"] * h, c["hidden_size"]),
    "self_attn.o_proj": lambda c, h: (c["hidden_size"], c["num_attention_heads"] * h),
    "mlp.gate_proj": lambda c, h: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj": lambda c, h: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj": lambda c, h: (c["hidden_size"], c["intermediate_size"]),
}


def write_random_adapter(path: str, config: dict, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of `rank` on every projection of a Llama-like `config`."""
    os.makedirs(path, exist_ok=True)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shapes = {}
    for i in range(config["num_hidden_layers"]):
        for module, shape_of in _TARGETS.items():
            rows, cols = shape_of(config, head_dim)
            prefix = f"base_model.model.model.layers.{i}.{module}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, cols)
            shapes[f"{prefix}.lora_B.weight"] = (rows, rank)
    rng = np.random.default_rng(seed)
    write_float32_safetensors(
        os.path.join(path, "adapter_model.safetensors"),
        shapes,
        lambda name, out: out.__setitem__(..., rng.normal(0.0, 0.02, out.shape)),
    )
    peft_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [m.split(".")[-1] for m in _TARGETS],
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config, f)


def bench(args, llm: LLM, prompt_sets, adapters: list | None) -> tuple[float, float]:
    """(batch-1 decode tok/s, the workload's output tok/s) of `llm`; each request runs the
    adapters in turn (None: the base model)."""

    def run(prompts, params):
        lora = (
            None if adapters is None else [adapters[i % len(adapters)] for i in range(len(prompts))]
        )
        llm.generate(prompts, params, lora_request=lora, use_tqdm=False)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm, prompt_sets = prompt_sets[0], prompt_sets[1:]  # timed prompts: none cached
    run(warm, params)  # compiles and reads the adapters
    one = warm[:1]
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True)
    run(one, long)
    step = (
        median_time(lambda i: run(one, long), args.num_iters)
        - median_time(lambda i: run(one, short), args.num_iters)
    ) / 64
    elapsed = median_time(lambda i: run(prompt_sets[i], params), args.num_iters)
    return 1 / step, args.num_prompts * args.output_len / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Llama-like HF directory (default model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-adapters", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--num-iters", type=int, default=3)
    args = parser.parse_args(argv)
    model = args.model or default_model_dir()
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    prompt_sets = [
        random_prompts(args.num_prompts, args.input_len, config["vocab_size"], i, 0.0)
        for i in range(args.num_iters + 1)
    ]  # the first warms up
    engine = {"dtype": args.dtype, "max_num_seqs": max(args.num_prompts, 8)}
    print(f"CPU: {cpu_name()}, Python {platform.python_version()}")
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} in x {args.output_len} out, "
        f"greedy, {args.dtype}, median of {args.num_iters}; LoRA: {args.num_adapters} "
        f"adapters of rank {args.lora_rank} on every projection, requests in turn"
    )
    results = {}
    with tempfile.TemporaryDirectory() as root:
        adapters = []
        for i in range(args.num_adapters):
            write_random_adapter(f"{root}/{i}", config, args.lora_rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, f"{root}/{i}"))
        for name, settings, requests in (
            ("base model", {}, None),
            ("LoRA", {"enable_lora": True, "max_loras": args.num_adapters,
                      "max_lora_rank": args.lora_rank}, adapters),
        ):  # fmt: skip
            llm = LLM(model, **engine, **settings)
            results[name] = bench(args, llm, prompt_sets, requests)
            del llm
            gc.collect()
    (b1_base, tput_base), (b1_lora, tput_lora) = results["base model"], results["LoRA"]
    print(f"{'engine':<12} {'batch-1 tok/s':>14} {'workload tok/s':>15}")
    for name, (b1, tput) in results.items():
        print(f"{name:<12} {b1:>14.1f} {tput:>15.1f}")
    print(f"LoRA / base: batch-1 {b1_lora / b1_base:.2f}x, workload {tput_lora / tput_base:.2f}x")


if __name__ == "__main__":
    main()
