"""The kinds of executable that chain a model runner's step, as the functions the runner jits
(every jax.jit entry point stays in model_runner.py): a single step (step_fn.py), a decode
window of steps (decode_loop.py), a window of speculative rounds (spec_window.py) and the
decode step run ahead of its schedule (async_step.py), each with its statics bound."""

import dataclasses
import functools
from collections.abc import Callable

from jvllm.core.engine_config import RunnerConfig
from jvllm.worker.async_step import next_decode_step
from jvllm.worker.decode_loop import run_window
from jvllm.worker.spec_window import run_spec_window
from jvllm.worker.step_fn import single_step


@dataclasses.dataclass(frozen=True)
class StepKinds:
    """What the kinds of executable bind besides the step: how far a window runs and how often
    it checks that a row still decodes (`runner_config.num_scheduler_steps`, `steps_per_check`:
    window_steps_per_check()), and what it returns."""

    runner_config: RunnerConfig
    steps_per_check: int
    # A model with routed experts: a window sums its steps' expert counts, (L_moe, E); None
    # without.
    expert_counts_shape: tuple[int, int] | None

    def body(self, kind: str, step: Callable) -> Callable:
        """The function of a `kind` executable ("step", "window", "spec_window" or "ahead")
        over `step` (step_fn.model_step, its statics and sampler plan bound)."""
        config = self.runner_config
        # What either kind of window binds besides its length: its step and what it returns.
        window = {
            "step": step,
            "max_logprobs": config.max_logprobs,
            "expert_counts_shape": self.expert_counts_shape,
        }
        if kind == "window":
            return functools.partial(
                run_window,
                num_steps=config.num_scheduler_steps,
                steps_per_check=self.steps_per_check,
                **window,
            )
        if kind == "spec_window":
            return functools.partial(
                run_spec_window,
                num_rounds=config.num_scheduler_steps,
                num_drafts=config.num_speculative_tokens,
                rounds_per_check=min(self.steps_per_check, config.num_scheduler_steps),
                prompt_lookup=config.prompt_lookup,
                **window,
            )
        if kind == "ahead":
            return functools.partial(next_decode_step, step=step)
        return functools.partial(single_step, step=step)
