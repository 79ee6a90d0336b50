"""The hand-over of data-parallel ranks' steps to their group's one step (worker/rank_group.py).

Each rank's engine steps in its own thread. A rank that scheduled tokens hands its step over
(`submit`) and waits; one that scheduled nothing just finishes (`finish`, which every rank
calls after its engine's step). When every local rank has done one or the other, the last to
arrive runs the group's step over the handed-over steps and wakes the others, each with its
own result, or with the step's error, which its engine then fails its own requests with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class StepHandOver:
    def __init__(
        self,
        local_ranks: list[int],
        run: Callable[[dict[int, Any]], dict[int, Any]],
        run_without_steps: bool,
    ):
        """`run(steps)`: the group's step, rank -> step handed over -> rank -> result.
        `run_without_steps`: run it even when no local rank handed a step over (across
        processes, where another process's rank may have one)."""
        self._local_ranks = local_ranks
        self._run = run
        self._run_without_steps = run_without_steps
        self._lock = threading.Condition()
        self._pending: set[int] = set()
        self._steps: dict[int, Any] = {}
        self._results: dict[int, Any] = {}

    def begin(self) -> None:
        """Before the ranks' engines step: every local rank is to hand over or finish."""
        with self._lock:
            self._pending = set(self._local_ranks)

    def finish(self, rank: int) -> None:
        """Rank `rank`'s engine stepped (whether or not it handed a step over)."""
        with self._lock:
            self._arrive(rank)

    def submit(self, rank: int, step: Any) -> Any:
        """Rank `rank`'s step -> its result, once the group's step has run."""
        with self._lock:
            if rank in self._steps or rank not in self._pending:
                raise RuntimeError(f"rank {rank} handed over a step outside its group's step")
            self._steps[rank] = step
            self._arrive(rank)
            while rank not in self._results:
                self._lock.wait()
            result = self._results.pop(rank)
        if isinstance(result, BaseException):
            raise result
        return result

    def _arrive(self, rank: int) -> None:
        """Under the lock: the last local rank to arrive runs the group's step and wakes the
        rest."""
        if rank not in self._pending:
            return
        self._pending.discard(rank)
        if self._pending or not (self._steps or self._run_without_steps):
            return
        steps, self._steps = self._steps, {}
        try:
            self._results.update(self._run(steps))
        except Exception as error:  # noqa: BLE001 - every rank's engine fails its own requests
            self._results.update((r, error) for r in steps)
        self._lock.notify_all()
