"""The vLLM v1 scheduler: one token budget per step shared by every request, no prefill or
decode phases. Each request's `num_computed_tokens` chases its `num_tokens`; a request samples
a token in the step where it catches up."""

import logging
from collections import deque
from collections.abc import Iterable

from jvllm.core.config import SchedulerConfig
from jvllm.core.decode_window import decode_window_limits, spec_window_lookahead
from jvllm.core.encoder_scheduler import EncoderScheduler
from jvllm.core.kv_cache_manager import KVCacheManager
from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.core.scheduling_policy import enqueue, pick_victim
from jvllm.core.spec_decode import DraftProposer
from jvllm.core.stop_checks import check_grammar, check_stop, never_fits

logger = logging.getLogger("jvllm.scheduler")


class Scheduler:
    """Decides each step which requests compute how many tokens, and owns their lifecycle:
    `waiting` -> `running` -> finished. `waiting` is in arrival order with preempted requests
    re-entering at its front (FCFS), or in (priority, arrival time) order under the "priority"
    policy; either way nobody overtakes its head."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        drafter: DraftProposer | None = None,
    ) -> None:
        """`drafter`: speculative decoding's draft proposer (None: no drafts)."""
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.drafter = drafter
        self.encoder = EncoderScheduler(scheduler_config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        # Prompt tokens computed (prefix-cache hits excluded) and tokens sampled, for stats.
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        enqueue(self.waiting, request, self.config.policy)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        has_newcomers = bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        window_limits = decode_window_limits(
            self.config, self.running, has_newcomers, self.kv_cache_manager, self._window_drafts
        )
        if window_limits is not None:
            self._schedule_window(output, window_limits)
        else:
            self.encoder.start_step()
            token_budget = self._schedule_running(output, self.config.max_num_batched_tokens)
            # A step that had to preempt is short of blocks: admitting now would only thrash.
            if not output.preempted_requests:
                self._schedule_waiting(output, token_budget)
        kv = self.kv_cache_manager
        for request in output.scheduled_requests:
            output.block_ids[request.request_id] = kv.get_block_ids(request.request_id)
            if kv.windows:
                window_ids = kv.get_window_block_ids(request.request_id)
                output.window_block_ids[request.request_id] = window_ids
        if output.scheduled_requests:  # else no worker call: the next step takes them
            output.freed_encoder_hashes = self.encoder.cache.take_freed_hashes()
        logger.debug(
            "schedule: %d steps, %d requests, %d tokens, %d preempted, %d ignored; "
            "%d running, %d waiting, KV usage %.1f%%",
            output.num_steps,
            len(output.scheduled_requests),
            output.total_num_scheduled_tokens,
            len(output.preempted_requests),
            len(output.finished_requests),
            len(self.running),
            len(self.waiting),
            100 * self.kv_cache_manager.usage,
        )
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, int],
        round_drafts: dict[str, list[tuple[int, int]]] | None = None,
    ) -> list[Request]:
        """Advance the counters, append the tokens of requests that caught up, check stops.

        A request's sampled tokens are an int, or a list of them from a decode window or a
        verification of drafts: each token after the first was computed in the step (its KV is
        in the cache: a window's sampled token, an accepted draft), and tokens after one that
        stops the request are dropped. `round_drafts`: from a window of speculative rounds,
        each request's (drafts proposed, drafts accepted) in each of its rounds. Returns every
        request finished in this step: the IGNORED ones from `schedule()`, then those that
        stopped now. They have left `running` and their blocks are freed.
        """
        stopped = []
        for request in scheduler_output.scheduled_requests:
            if request.is_finished:  # aborted between schedule() and now
                continue
            computed = request.num_computed_tokens
            # Drafts are not counted here: the accepted ones are, as their tokens are appended.
            request.num_computed_tokens += scheduler_output.num_known_tokens(request)
            if request.mm_features:
                self.encoder.cache.release_computed(request)
            self.num_prompt_tokens_total += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - computed
            )
            # A mid-prefill chunk samples nothing, whatever the runner returned for it.
            if request.num_computed_tokens < request.num_tokens:
                continue
            if request.pooling_params is not None:  # its whole prompt is pooled: done
                request.status = RequestStatus.FINISHED_STOPPED
                stopped.append(request)
                self._free_finished(request)
                continue
            token_ids = sampled_token_ids.get(request.request_id)
            if token_ids is None:
                continue
            drafts = scheduler_output.spec_token_ids.get(request.request_id, [])
            rounds = (round_drafts or {}).get(request.request_id)
            if rounds:  # a window of speculative rounds: its own drafts, then the device's
                self.drafter.observe_window(request, drafts, rounds)
            elif drafts:
                self.drafter.stats.observe(len(drafts), len(token_ids) - 1)
            for i, token_id in enumerate([token_ids] if isinstance(token_ids, int) else token_ids):
                request.num_computed_tokens += i > 0
                request.append_output_token_ids(token_id)
                self.num_generation_tokens_total += 1
                if check_grammar(request, token_id) or check_stop(
                    request, self.config.max_model_len
                ):
                    stopped.append(request)
                    self._free_finished(request)
                    break
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return scheduler_output.finished_requests + stopped

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_finished(request)

    @property
    def _window_drafts(self) -> int:
        """Drafts a round of a decode window verifies: k with speculation (a draft model or head
        proposes them on the device, n-gram drafts are looked up there: worker/spec_window.py);
        else 0."""
        return self.drafter.config.num_speculative_tokens if self.drafter else 0

    def _schedule_window(self, output: SchedulerOutput, limits: list[int]) -> None:
        output.num_steps = self.config.num_scheduler_steps
        k = self._window_drafts
        for request, limit in zip(self.running, limits, strict=True):
            # Blocks for every token the window may compute: decode_window_limits counted them.
            lookahead = spec_window_lookahead(request, limit, k, self.config.max_model_len)
            self.kv_cache_manager.allocate_slots(request, limit + lookahead)
            output.scheduled_requests.append(request)
            output.window_limits[request.request_id] = limit
            # The first round's drafts: the last step's proposals (the runner pads them to k).
            drafts = self.drafter.drafts_for(request, 1 + k) if k else []
            output.num_scheduled_tokens[request.request_id] = 1 + len(drafts)
            if drafts:
                output.spec_token_ids[request.request_id] = drafts

    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = self._num_new_tokens(request, token_budget)
            encode, num_new_tokens = self.encoder.inputs_for(
                request, request.num_computed_tokens, num_new_tokens
            )
            # 0: caught up, but the runner returned no token for it; or its next image does
            # not fit this step's encoder budget.
            if num_new_tokens == 0:
                index += 1
                continue
            drafts = self._drafts(request, num_new_tokens, token_budget)
            lookahead = self._num_lookahead(
                request, request.num_computed_tokens, num_new_tokens, len(drafts)
            )
            while (
                self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens + len(drafts) + lookahead
                )
                is None
            ):
                if drafts or lookahead:  # short of blocks: decode plainly before preempting
                    drafts, lookahead = [], 0
                    continue
                victim = pick_victim(self.running, self.config.policy)
                if victim.request_id in output.num_scheduled_tokens:  # scheduled this step: undo
                    output.scheduled_requests.remove(victim)
                    token_budget += output.num_scheduled_tokens.pop(victim.request_id)
                    output.spec_token_ids.pop(victim.request_id, None)
                    self.encoder.undo(
                        victim, output.scheduled_encoder_inputs.pop(victim.request_id, []), output
                    )
                    # Its blocks were entered in the prefix cache for KV this step never writes.
                    self.kv_cache_manager.uncache_uncomputed_blocks(victim)
                if self.running.index(victim) < index:  # the requests after it move up one
                    index -= 1
                self.running.remove(victim)
                if victim is request:
                    self.encoder.undo(request, encode, output)
                self._preempt(victim)
                output.preempted_requests.append(victim)
                if victim is request:
                    return token_budget
            if drafts:
                output.spec_token_ids[request.request_id] = drafts
                num_new_tokens += len(drafts)
            if encode:
                output.scheduled_encoder_inputs[request.request_id] = encode
            output.scheduled_requests.append(request)
            output.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def _num_lookahead(
        self, request: Request, num_computed: int, num_new_tokens: int, num_drafts: int = 0
    ) -> int:
        """KV slots past the step's tokens (and drafts) for a request that samples in it: a
        draft model writes its KV at the positions of the drafts it then proposes (vLLM's
        num_lookahead_tokens), within max_model_len."""
        if self.drafter is None or num_computed + num_new_tokens != request.num_tokens:
            return 0
        room = self.config.max_model_len - request.num_tokens - num_drafts
        return max(0, min(self.drafter.num_lookahead_tokens, room))

    def _drafts(self, request: Request, num_new_tokens: int, token_budget: int) -> list[int]:
        """Speculative drafts for a request that decodes (computes its last token) this step."""
        is_decoding = request.num_computed_tokens + num_new_tokens == request.num_tokens
        if self.drafter is None or num_new_tokens != 1 or not is_decoding:
            return []
        return self.drafter.drafts_for(request, token_budget)

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        kv = self.kv_cache_manager
        # Requests whose grammar is still compiling, or whose LoRA adapter would be one more
        # than max_loras beside the running requests', wait without holding back those behind.
        set_aside: list[Request] = []
        adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            grammar = request.structured_output
            if grammar is not None and not grammar.is_ready():
                set_aside.append(self.waiting.popleft())
                continue
            adapter = request.lora_request.lora_int_id if request.lora_request else None
            is_new_adapter = adapter is not None and adapter not in adapters
            if is_new_adapter and len(adapters) >= self.config.max_loras:
                set_aside.append(self.waiting.popleft())
                continue
            if grammar is not None and grammar.error:
                self._finish_failed_grammar(self.waiting.popleft())
                output.finished_requests.append(request)
                continue
            if self._finish_if_never_fits(request):
                self.waiting.popleft()
                output.finished_requests.append(request)
                continue
            hit_blocks, num_hit_tokens = [], 0
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            if request.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                break
            num_new_tokens = self._num_new_tokens(request, token_budget, num_hit_tokens)
            encode, num_new_tokens = self.encoder.inputs_for(
                request, num_hit_tokens, num_new_tokens
            )
            if num_new_tokens == 0:  # its next image does not fit this step (encoder_scheduler)
                self.encoder.undo(request, encode, output)
                break
            lookahead = self._num_lookahead(request, num_hit_tokens, num_new_tokens)
            if kv.allocate_slots(
                request, num_new_tokens + lookahead, hit_blocks, num_hit_tokens
            ) is None and (
                lookahead == 0  # else again without: the request proposes fewer drafts
                or kv.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens) is None
            ):
                self.encoder.undo(request, encode, output)
                break  # FCFS: nobody overtakes the head of the queue.
            if encode:
                output.scheduled_encoder_inputs[request.request_id] = encode
            kv.record_prefix_lookup(request, num_hit_tokens)
            self.waiting.popleft()
            self.running.append(request)
            if adapter is not None:
                adapters.add(adapter)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            output.scheduled_requests.append(request)
            output.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        self.waiting.extendleft(reversed(set_aside))

    def _finish_failed_grammar(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        request.status_message = request.structured_output.error
        self._free_finished(request)
        logger.warning("aborted %s: %s", request.request_id, request.status_message)

    def _num_new_tokens(
        self, request: Request, token_budget: int, num_computed: int | None = None
    ) -> int:
        """What the request still lacks, capped by the long-prefill threshold and the budget."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_new_tokens = request.num_tokens - num_computed
        if self.config.long_prefill_token_threshold > 0:
            num_new_tokens = min(num_new_tokens, self.config.long_prefill_token_threshold)
        return min(num_new_tokens, token_budget)

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, requeue (at the front under
        FCFS)."""
        self.kv_cache_manager.free(request)
        self.encoder.cache.release_all(request)
        request.status = RequestStatus.PREEMPTED
        if self.drafter is not None:
            self.drafter.discard(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        enqueue(self.waiting, request, self.config.policy, front=True)
        logger.info(
            "preempted %s (%d tokens, preemption #%d)",
            request.request_id,
            request.num_tokens,
            request.num_preemptions,
        )

    def _finish_if_never_fits(self, request: Request) -> bool:
        """Finish a waiting request that could never be scheduled, instead of letting it block
        the queue forever."""
        never = never_fits(request, self.kv_cache_manager, self.config)
        if never is None:
            return False
        request.status, request.status_message = never
        self._free_finished(request)
        logger.warning("finished %s as %s: %s", request.request_id, never[0].name, never[1])
        return True

    def _free_finished(self, request: Request) -> None:
        if self.drafter is not None:
            self.drafter.discard(request.request_id)
        self.kv_cache_manager.free(request)
        self.encoder.cache.release_all(request)
        del self.requests[request.request_id]
