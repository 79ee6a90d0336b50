"""Output quality of an engine configuration against a baseline: perplexity of a fixed text and
agreement of greedy tokens on a fixed prompt set. Quantization (weights, KV cache) is judged by
how far these move from the full-precision engine's.

    python -m jvllm.benchmarks.quality --compare dtype=bfloat16 [--compare quantization=int8 ...]

Each config is `key=value` pairs of `LLM` keyword arguments (EngineArgs fields); the first,
--baseline (default dtype=float32), is what the others are measured against. Each engine is
built in turn and freed before the next. Tests call the functions with their own `LLM`:

    reference = greedy_token_ids(LLM(dtype="float32"))
    agreement = greedy_agreement(greedy_token_ids(LLM(quantization="int8")), reference)
"""

import argparse
import dataclasses
import gc
import math
import os
import statistics
from collections.abc import Sequence

from jvllm import LLM, SamplingParams

# Source and licence: data/README.md.
PERPLEXITY_TEXT_PATH = os.path.join(os.path.dirname(__file__), "data", "pride_and_prejudice.txt")
NUM_GREEDY_TOKENS = 16
# Varied short prompts (prose, facts, lists, code, dialogue) for the greedy comparison.
GREEDY_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\n\nx = np.",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
    "Dear Sir or Madam,\n\nI am writing to",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
    "<html>\n<head>\n<title>",
    "The best way to learn a new language is",
)


def perplexity_text() -> str:
    """The shipped perplexity text (572 tokens of English prose with the SmolLM2 tokenizer)."""
    with open(PERPLEXITY_TEXT_PATH, encoding="utf-8") as f:
        return f.read()


def perplexity(llm: LLM, text: str | None = None) -> float:
    """exp of the mean negative log-likelihood of `text`'s tokens (the shipped text by default),
    each predicted from those before it; the first token, which nothing predicts, is left out."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    output = llm.generate([perplexity_text() if text is None else text], params, use_tqdm=False)[0]
    token_ids, entries = output.prompt_token_ids[1:], output.prompt_logprobs[1:]
    if not token_ids:
        raise ValueError("the text must be at least two tokens long")
    nll = -sum(entry[token_id].logprob for token_id, entry in zip(token_ids, entries, strict=True))
    return math.exp(nll / len(token_ids))


def greedy_token_ids(
    llm: LLM, prompts: Sequence[str] = GREEDY_PROMPTS, num_tokens: int = NUM_GREEDY_TOKENS
) -> list[list[int]]:
    """The first `num_tokens` greedy tokens of each prompt (EOS ignored, so always that many)."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


@dataclasses.dataclass(frozen=True)
class GreedyAgreement:
    """Per prompt, how many tokens match the reference's before the first difference."""

    common_prefix_lens: tuple[int, ...]
    num_tokens: int

    @property
    def num_all_equal(self) -> int:
        """Prompts whose `num_tokens` tokens all equal the reference's."""
        return sum(n == self.num_tokens for n in self.common_prefix_lens)

    @property
    def median_common_prefix(self) -> float:
        return statistics.median(self.common_prefix_lens)


def greedy_agreement(
    token_ids: Sequence[Sequence[int]],
    reference_token_ids: Sequence[Sequence[int]],
    num_tokens: int = NUM_GREEDY_TOKENS,
) -> GreedyAgreement:
    """Agreement of `token_ids` (one list per prompt, as `greedy_token_ids` returns) with the
    reference's over each prompt's first `num_tokens` tokens."""
    if len(token_ids) != len(reference_token_ids):
        raise ValueError(
            f"got {len(token_ids)} prompts' tokens against {len(reference_token_ids)} "
            "in the reference"
        )
    lens = []
    for ours, theirs in zip(token_ids, reference_token_ids):
        ours, theirs = list(ours[:num_tokens]), list(theirs[:num_tokens])
        if len(theirs) < num_tokens:
            raise ValueError(f"the reference has {len(theirs)} tokens, fewer than {num_tokens}")
        n = 0
        while n < len(ours) and ours[n] == theirs[n]:
            n += 1
        lens.append(n)
    return GreedyAgreement(tuple(lens), num_tokens)


def parse_engine_kwargs(pairs: Sequence[str]) -> dict:
    """`key=value` strings as LLM keyword arguments: values read as int, float, true/false,
    none, or else str (`dtype=bfloat16`, `max_num_seqs=8`, `enable_prefix_caching=false`)."""
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"expected key=value with key an option name, got {pair!r}")
        kwargs[key] = _parse_value(value)
    return kwargs


def _parse_value(value: str) -> int | float | bool | str | None:
    words = {"true": True, "false": False, "none": None}
    if value.lower() in words:
        return words[value.lower()]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


@dataclasses.dataclass(frozen=True)
class _Measured:
    name: str
    perplexity: float
    token_ids: list[list[int]]


def _measure(name: str, kwargs: dict) -> _Measured:
    """Build the engine, measure it, and free it before the next is built."""
    llm = LLM(**kwargs)
    measured = _Measured(name, perplexity(llm), greedy_token_ids(llm))
    del llm
    gc.collect()
    return measured


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument(
        "--baseline",
        nargs="+",
        default=["dtype=float32"],
        metavar="KEY=VALUE",
        help="LLM keyword arguments of the reference config",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="LLM keyword arguments of a config to measure; repeat for more configs",
    )
    args = parser.parse_args(argv)
    try:
        configs = [(" ".join(c), parse_engine_kwargs(c)) for c in [args.baseline, *args.compare]]
    except ValueError as e:
        parser.error(str(e))

    runs = [_measure(name, {"model": args.model, **kwargs}) for name, kwargs in configs]
    base = runs[0]
    print(
        f"model: {args.model or 'SmolLM2-135M-Instruct'}; perplexity of {os.path.basename(PERPLEXITY_TEXT_PATH)}; "
        f"greedy: {len(GREEDY_PROMPTS)} prompts x {NUM_GREEDY_TOKENS} tokens against the first"
    )
    width = max(len(run.name) for run in runs)
    print(
        f"{'config':<{width}} {'perplexity':>10} {'ratio':>6} {'all equal':>9} {'median prefix':>13}"
    )
    for run in runs:
        agreement = greedy_agreement(run.token_ids, base.token_ids)
        print(
            f"{run.name:<{width}} {run.perplexity:>10.3f} {run.perplexity / base.perplexity:>6.3f} "
            f"{f'{agreement.num_all_equal}/{len(GREEDY_PROMPTS)}':>9} "
            f"{agreement.median_common_prefix:>13g}"
        )


if __name__ == "__main__":
    main()
