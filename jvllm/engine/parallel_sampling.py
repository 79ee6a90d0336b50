"""n > 1: a parent request fans out into n child requests `"{i}_{request_id}"` that share the
prompt's KV blocks through the prefix cache, and gathers their completions back (vLLM's
ParentRequest)."""

import dataclasses

from jvllm.outputs import CompletionOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One sample of the n: a seeded parent gives child i the seed `seed + i`, as vLLM does."""
    seed = None if params.seed is None else (params.seed + index) % 2**32
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        self._running = set(self.child_ids)
        self._final: dict[int, CompletionOutput] = {}

    def drop(self, child_id: str) -> None:
        """A sample that failed: the others no longer wait for it."""
        self._running.discard(child_id)

    def get_outputs(
        self, child_id: str, completion: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """(the completions to report now, whether every child has finished). Streaming kinds
        report each child's completion as it comes; FINAL_ONLY reports all n at the end."""
        if completion.finished():
            self._running.discard(child_id)
        finished = not self._running
        if self.params.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion], finished
        self._final[completion.index] = completion
        if not finished:
            return [], False
        return [self._final[i] for i in sorted(self._final)], True
