"""Sampler plans: a step's sampling stages fixed when it compiles, so that a GPU never waits.

The sampler's optional stages each sit behind a batch-level switch, a `lax.cond` on a flag the
step computes on the host (sample/metadata.py). That is cheap on a CPU. On a GPU, XLA's
conditional copies the flag to the host and waits for the stream to drain before it launches a
branch, so the host thread that dispatches a step is held until the forward is done: it cannot
prepare the next step meanwhile, and async scheduling overlaps nothing (BENCHMARKS.md, "Layers
split on a GPU": an 8B batch-1 step returned from its dispatch 0.5 ms before its results).

A plan names the stages a step runs instead, as a static argument: an executable compiled for
GREEDY, RANDOM or FILTERED has no conditional. DYNAMIC keeps the switches: what a step with
penalties, logit processors, grammar masks or logprobs runs.
"""

import enum
import os

import jax

from jvllm.sample.metadata import SamplingMetadata

# "1": steps run their plan's executable on every backend, "0": always the switches; unset: on
# a GPU.
SAMPLER_PLANS_ENV = "JVLLM_SAMPLER_PLANS"


class SamplerPlan(enum.Enum):
    DYNAMIC = "dynamic"  # every stage behind its lax.cond
    GREEDY = "greedy"  # every row greedy: argmax only
    RANDOM = "random"  # temperature and seeds, no top-k / top-p / min-p
    FILTERED = "filtered"  # temperature and seeds, top-k / top-p / min-p


def choose_plan(md: SamplingMetadata) -> SamplerPlan:
    """The plan of a step whose host-side metadata (numpy flags) is `md`."""
    switches = (
        md.any_penalties,
        md.any_bias,
        md.any_constrained,
        md.any_logprobs,
        md.any_prompt_logprobs,
    )
    if any(bool(s) for s in switches):
        return SamplerPlan.DYNAMIC
    if md.all_greedy:
        return SamplerPlan.GREEDY
    return SamplerPlan.FILTERED if md.any_filter else SamplerPlan.RANDOM


def use_sampler_plans() -> bool:
    """Whether the runner compiles steps for their plans (see the module docstring)."""
    setting = os.environ.get(SAMPLER_PLANS_ENV)
    if setting not in (None, "0", "1"):
        raise ValueError(f"{SAMPLER_PLANS_ENV}={setting!r}; allowed: '0', '1' or unset")
    return jax.default_backend() == "gpu" if setting is None else setting == "1"
