"""A step-loop experiment: the entropy of every sequence's next-token distribution at each of
256 decode steps, run as jitted loops over the engine's own decode step, with the time per
step when the host calls the device every step (k = 1) and every 32 steps (k = 32).

    python examples/jitted_step_loop.py [--model DIR] [--num-steps 256] [--dtype bfloat16]

The loop's tokens are checked against `LLM.generate` on the same prompts.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from jvllm import LLM, SamplingParams
from jvllm.step_loop import StepLoop

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
# Untimed steps first: each k's first call compiles.
WARM_UP_STEPS = 64


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy in nats of softmax(logits f32[S, V]) -> f32[S]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def run(llm: LLM, params: SamplingParams, num_steps: int, k: int):
    """The experiment, k steps per device call -> (token ids per prompt, entropies [n, S],
    active [n, S], median seconds per step)."""
    loop = StepLoop(llm)
    state = loop.prefill(PROMPTS, params)

    @loop.jit
    def k_steps(state):
        def body(i, carry):
            state, tokens, active, entropies = carry
            state, out = loop.step(state)
            return (
                state,
                tokens.at[i].set(out.token_ids),
                active.at[i].set(out.active),
                entropies.at[i].set(entropy(out.logits)),
            )

        shape = (k, state.stops.limits.shape[0])
        init = (state, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool), jnp.zeros(shape))
        return jax.lax.fori_loop(0, k, body, init)

    results, seconds = [], []
    for _ in range((WARM_UP_STEPS + num_steps) // k):
        start = time.perf_counter()
        state, *result = k_steps(state)
        jax.block_until_ready(result)
        seconds.append(time.perf_counter() - start)
        results.append(result)
    tokens, active, entropies = (jnp.concatenate(parts) for parts in zip(*results))
    timed = sorted(seconds[WARM_UP_STEPS // k :])
    return loop.finish(state, tokens, active), entropies, active, timed[len(timed) // 2] / k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-steps", type=int, default=256, help="a multiple of 32")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.num_steps <= 0 or args.num_steps % 32:
        parser.error(f"--num-steps must be a positive multiple of 32, got {args.num_steps}")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=len(PROMPTS), max_model_len=1024)
    # Every row decodes through all the loop's steps: one token from the prefill, then these.
    params = SamplingParams(
        temperature=0.0, max_tokens=1 + WARM_UP_STEPS + args.num_steps, ignore_eos=True
    )
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for k in (1, 32):
        token_ids, entropies, active, seconds = run(llm, params, args.num_steps, k)
        assert token_ids == expected, f"k={k}: the loop's tokens differ from LLM.generate's"
        print(f"k={k:2d}: {1000 * seconds:.2f} ms per decode step of {len(PROMPTS)} sequences")
    mean = jnp.sum(entropies * active, axis=0) / jnp.maximum(jnp.sum(active, axis=0), 1)
    tokenizer = llm.get_tokenizer()
    for prompt, h, ids in zip(PROMPTS, mean.tolist(), token_ids):
        text = tokenizer.decode(ids[:10], skip_special_tokens=True)
        print(f"mean entropy {h:.2f} nats: {prompt!r} -> {text!r}...")
    print("the loop's tokens equal LLM.generate's")


if __name__ == "__main__":
    main()
