"""The requests an LLMEngine lends a jvllm.step_loop.StepLoop: taken out of the scheduler, each
given the KV blocks for every token it may sample, so that the loop decodes them on the device
without coming back to the host; the engine takes no request until they come back."""

from jvllm.core.request import Request
from jvllm.core.scheduler import Scheduler


class StepLoopLease:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._lent: list[Request] = []
        self.is_held = False  # between a loop's prefill and its finish

    def lend(
        self, requests: list[Request], limits: list[int]
    ) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Running `requests`, each with the blocks for `limits[i]` tokens in all -> each one's
        block ids, and its tables in the windowed KV groups (core/kv_groups.py). ValueError where the cache cannot hold them (`take_back` then returns the
        blocks they got, through the engine's abort)."""
        kv = self._scheduler.kv_cache_manager
        self._lent = list(requests)
        for request, limit in zip(requests, limits):
            if kv.allocate_slots(request, limit) is None:
                raise ValueError(
                    "the KV cache is too small to hold every token of the loop's requests; "
                    "pass fewer prompts or a lower max_tokens, or raise kv_cache_memory_bytes"
                )
        for request in requests:
            self._scheduler.running.remove(request)  # the loop decodes it, not engine.step()
        self.is_held = True
        return (
            [kv.get_block_ids(r.request_id) for r in requests],
            [kv.get_window_block_ids(r.request_id) for r in requests],
        )

    def take_back(self) -> None:
        """The lent requests that have not finished go back to the scheduler's running ones."""
        self.is_held = False
        running = self._scheduler.running
        lent, self._lent = self._lent, []
        running.extend(r for r in lent if not r.is_finished and r not in running)
