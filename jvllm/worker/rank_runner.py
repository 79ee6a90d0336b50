"""One data-parallel rank's view of its group's runner (worker/rank_group.py): what the rank's
LLMEngine runs as its model runner. Its steps are handed over to the group's one step, and
its params, KV cache, adapters and drafts are the group's."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jvllm.core.request import Request
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from jvllm.worker.rank_group import RankGroupRunner


@dataclasses.dataclass
class RankStep:
    """One rank's step handed to the group: what its runner would have run alone."""

    scheduler_output: SchedulerOutput
    block_ids: list[list[int]]
    token_bitmask: np.ndarray | None


def step_requests(step: RankStep) -> list:
    """The requests `step` schedules, in order."""
    return step.scheduler_output.scheduled_requests


class _NoCompiler:
    """What the engine asks a runner's compiler: the group compiles its executables itself
    (one a bucket and kind: up front with compile_all_buckets, else on first use), nothing in
    the background."""

    lockstep = False
    compile_wait_seconds = 0.0

    def cancel_compiles(self) -> None:
        pass

    def wait_for_compiles(self) -> None:
        pass


class RankRunner:
    """One rank's view of the group, what its LLMEngine runs as its model runner."""

    encoder = None  # images are refused across ranks

    def __init__(self, group: RankGroupRunner, rank: int):
        self.group, self.rank = group, rank
        self.config = group.config
        self.compiler = _NoCompiler()
        self.dispatch_seconds = self.device_wait_seconds = 0.0

    @property
    def params(self):
        return self.group.params

    @property
    def adapters(self):
        """This rank's AdapterSlots (None: no LoRA), which its engine reads adapters with."""
        return self.group.adapters and self.group.adapters.slots[self.rank]

    @property
    def kv_cache(self):
        return self.group.kv_cache

    @property
    def expert_token_counts(self) -> np.ndarray:
        return self.group.expert_token_counts[self.rank]

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        block_ids: list[list[int]],
        token_bitmask: np.ndarray | None = None,
    ) -> ModelRunnerOutput:
        """ModelRunner.execute_model's contract: this rank's step, run in the group's."""
        step = RankStep(scheduler_output, block_ids, token_bitmask)
        return self.group.hand_over.submit(self.rank, step)

    def execute_pooling(
        self, scheduler_output: SchedulerOutput, block_ids: list[list[int]]
    ) -> np.ndarray:
        """ModelRunner.execute_pooling's contract: this rank's pooling step, run in the
        group's."""
        step = RankStep(scheduler_output, block_ids, None)
        return self.group.hand_over.submit(self.rank, step)

    def propose_drafts(
        self, requests: list[Request], block_ids: list[list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The drafts this rank's last step proposed for `requests` (DraftProposals.propose)."""
        return self.group.proposals[self.rank].propose(requests, block_ids)
