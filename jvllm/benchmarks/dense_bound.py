"""The throughput benchmark's ceiling on this machine: jvllm's steps with attention for free.

    python -m jvllm.benchmarks.dense_bound --num-prompts 64 --input-len 128 --output-len 128 \
        --dtype float32

Times the model's own forward (models/model.py, jitted; the default model unless --model, random
weights with --load-format dummy) with attention replaced by a pass-through that costs nothing,
at the step shapes the engine runs for that workload: the prompts in steps of
max_num_batched_tokens tokens, then one step per output token for all prompts at once, each with
the LM head on its sampling rows. No attention backend, sampler or scheduler can make the engine
faster than that. HF transformers `generate` runs the same workload in the same process (as in
jvllm.benchmarks.throughput, with the same options), and the ratio printed is the most jvllm
could reach against it here.
"""

import argparse
import functools
import math

import jax
import jax.numpy as jnp

from jvllm.benchmarks.workload import (
    add_workload_args,
    bench_hf,
    median_time,
    random_prompts,
    require_hf,
)
from jvllm.model_loader.loader import load_model
from jvllm.models.model import compute_logits, forward


def _free_attention(layer, q, k, v, kv_cache, metadata):
    """The model contract's `attn`, at no cost: q [T, N, H] stands in for its output."""
    return q, kv_cache


# The benchmark's own jit, not one of the engine's entry points (those are in the model runner).
@functools.partial(jax.jit, static_argnames=("config", "num_sampling_rows"))
def _dense_step(params, token_ids, *, config, num_sampling_rows: int):
    """forward over token_ids i32[T] + the LM head on the last num_sampling_rows rows."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    hidden, _ = forward(
        params, jnp.zeros(()), token_ids, positions, None, config=config, attn=_free_attention
    )
    return compute_logits(params, hidden[-num_sampling_rows:], config=config)


def _step_seconds(params, config, num_tokens: int, num_sampling_rows: int, num_iters: int):
    """Median wall time of one dense step of num_tokens tokens (after a compile run)."""
    token_ids = jnp.ones((num_tokens,), jnp.int32)

    def run(_):
        out = _dense_step(params, token_ids, config=config, num_sampling_rows=num_sampling_rows)
        jax.block_until_ready(out)

    run(None)
    return median_time(run, num_iters)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if not args.skip_hf:
        require_hf()

    config, params, _ = load_model(args.model, args.dtype, args.load_format)
    prompt_tokens = args.num_prompts * args.input_len
    budget = args.max_num_batched_tokens
    num_prefill_steps = math.ceil(prompt_tokens / budget)
    prompts_per_step = math.ceil(args.num_prompts / num_prefill_steps)
    num_full_steps, last_step_tokens = divmod(prompt_tokens, budget)
    prefill = sum(
        count * _step_seconds(params, config, num_tokens, prompts_per_step, args.num_iters)
        for count, num_tokens in ((num_full_steps, budget), (1, last_step_tokens))
        if count and num_tokens
    )
    decode_step = _step_seconds(params, config, args.num_prompts, args.num_prompts, args.num_iters)
    decode = (args.output_len - 1) * decode_step
    total = prefill + decode
    tok_s = args.num_prompts * args.output_len / total
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} in x {args.output_len} out, "
        f"{args.dtype}, "
        + ("random weights (load_format dummy), " if args.load_format == "dummy" else "")
        + f"median of {args.num_iters} per step shape"
    )
    print(
        f"dense floor: {num_prefill_steps} prefill steps {prefill:.2f}s + {args.output_len - 1} "
        f"decode steps x {decode_step * 1e3:.1f} ms = {total:.2f}s -> at most {tok_s:.1f} "
        "output tok/s"
    )
    if not args.skip_hf:
        prompt_sets = [
            random_prompts(args.num_prompts, args.input_len, config.vocab_size, args.seed + i)
            for i in range(args.num_iters)
        ]
        theirs = bench_hf(args, prompt_sets)
        print(f"HF transformers generate: {theirs['tok_s']:.1f} output tok/s")
        print(f"most jvllm / HF could reach here: {tok_s / theirs['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
