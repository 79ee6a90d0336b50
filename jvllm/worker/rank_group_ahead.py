"""Async scheduling in a group of data-parallel ranks (worker/rank_group.py): the group's next
decode step, dispatched right behind a step where every rank decodes one token of each request
and needs no new block (async_step.can_run_ahead, each rank's), each rank's rows fed the
tokens just sampled; the next group step takes it where it holds every rank's schedule
(async_step.rows_ahead, each rank's), else drops it. Across processes both decisions ride on
the exchange of step sizes, so every process runs the same executables.
"""

from __future__ import annotations

import jax

from jvllm.sample.plan import SamplerPlan
from jvllm.worker.async_step import StepAhead, can_run_ahead, rows_ahead
from jvllm.worker.buckets import Bucket
from jvllm.worker.rank_runner import RankStep, step_requests


class GroupStepsAhead:
    def __init__(self, is_enabled: bool, block_size: int, waits: bool):
        """`is_enabled`: async_scheduling; `waits`: wait for each step run ahead before the
        group step returns. XLA:CPU runs executables side by side, so across processes a step
        left running reaches its collectives beside the next exchange of the processes' step
        sizes, in no order they agree on (gloo's pairs then mismatch); on a CPU it overlaps
        nothing anyway (sample/plan.py), and a GPU orders both on its stream."""
        self.is_enabled, self._block_size, self._waits = is_enabled, block_size, waits
        self._ahead: dict[int, StepAhead] | None = None  # each local rank's, over the group's
        self.num_used = self.num_dropped = 0

    def take(self) -> dict[int, StepAhead] | None:
        """The step run ahead, if any; it is no longer kept."""
        ahead, self._ahead = self._ahead, None
        return ahead

    def rows(self, ahead, rank: int, step: RankStep, num_bias_sends: int) -> list[int] | None:
        """The rows of `ahead` that hold rank `rank`'s `step`, in order (its bias rows sent
        first: `num_bias_sends`); None where they do not, or nothing ran ahead."""
        if ahead is None:
            return None
        return rows_ahead(ahead[rank], step.scheduler_output, step.block_ids, num_bias_sends)

    def can_follow(self, step: RankStep) -> bool:
        """Whether a step run ahead could follow this rank's `step`."""
        return self.is_enabled and can_run_ahead(
            step.scheduler_output, step.block_ids, self._block_size
        )

    def keep(
        self,
        steps: dict[int, RankStep],
        rows_of,
        bucket: Bucket,
        flags,
        out,
        inputs,
        num_bias_sends,
    ):
        """Keep the step just dispatched ahead in `bucket` (its outputs `out`, its inputs
        `inputs`, the group's): each local rank's (`num_bias_sends`' keys) rows `rows_of`
        holding its `steps`' requests, `flags` each one's (any_logprobs, _)."""
        if self._waits:
            jax.block_until_ready(out)
        self._ahead = {
            r: StepAhead.of_rows(
                rows_of.get(r, []),
                step_requests(steps[r]) if r in steps else [],
                steps[r].block_ids if r in steps else [],
                num_bias_sends=num_sends,
                bucket=bucket,
                any_logprobs=r in flags and flags[r][0],
                plan=SamplerPlan.DYNAMIC,
                out=out,
                inputs=inputs,
            )
            for r, num_sends in num_bias_sends.items()
        }
