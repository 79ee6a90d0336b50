"""Turns requests' new tokens into `RequestOutput`s: detokenization, stop strings, logprobs,
output kinds, and the gathering of parallel samples."""

import dataclasses

import numpy as np

from jvllm.core.request import Request, RequestStatus
from jvllm.core.scheduler_output import SchedulerOutput
from jvllm.engine.detokenizer import IncrementalDetokenizer
from jvllm.engine.logprobs import TokenDecoder, logprobs_entry
from jvllm.engine.parallel_sampling import ParentRequest
from jvllm.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from jvllm.sampling_params import RequestOutputKind


@dataclasses.dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer | None
    parent: ParentRequest | None
    index: int  # which of the parent's n samples
    num_processed: int = 0  # output tokens already detokenized
    text: str = ""  # output text, cut at a stop string
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    # DELTA outputs: what earlier outputs already carried.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    sent_prompt_logprobs: bool = False


def _find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first of `stops`, in their order (vLLM's), found in `text` overlapping its last
    `num_new_chars` characters, and where it starts."""
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if idx != -1:
            return stop, idx
    return None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = TokenDecoder(tokenizer)
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request: Request, parent: ParentRequest | None = None, index: int = 0
    ) -> None:
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        state = _RequestState(detok, parent, index)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * request.num_prompt_tokens
        self._states[request.request_id] = state

    def has_new_tokens(self, request: Request) -> bool:
        return self._states[request.request_id].num_processed < request.num_output_tokens

    def _decoder(self, request: Request):
        return self._decode if request.sampling_params.detokenize else (lambda _: None)

    def add_logprobs(
        self, request: Request, token_id: int, top_ids, top_logprobs, token_logprob, rank
    ) -> None:
        """Record the logprobs of the request's next output token (one row of the runner's)."""
        state = self._states[request.request_id]
        if state.logprobs is None:
            return
        state.logprobs.append(
            logprobs_entry(
                request.sampling_params.logprobs,
                top_ids,
                top_logprobs,
                token_id,
                token_logprob,
                rank,
                self._decoder(request),
            )
        )
        state.cumulative_logprob += float(token_logprob)

    def add_step_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        logprobs: tuple,
        sampling: list[Request],
        num_outputs: dict[str, int],
    ) -> None:
        """Record one step's logprobs (top ids, top logprobs, sampled logprobs, ranks; rows: the
        step's scheduled requests, with a leading token axis for a decode window or a step
        with drafts) for the requests in `sampling` that asked for them and were not aborted:
        their output tokens from `num_outputs`, each one's output count before the update, on."""
        rows = {r.request_id: i for i, r in enumerate(scheduler_output.scheduled_requests)}
        is_window = scheduler_output.num_steps > 1 or bool(scheduler_output.spec_token_ids)
        top_ids, top_lps, token_lps, ranks = logprobs
        for request in sampling:
            if (
                request.sampling_params.logprobs is None
                or request.status == RequestStatus.FINISHED_ABORTED
            ):
                continue
            row, first = rows[request.request_id], num_outputs[request.request_id]
            for j, token_id in enumerate(request.output_token_ids[first:]):
                at = (j, row) if is_window else (row,)
                self.add_logprobs(
                    request, token_id, top_ids[at], top_lps[at], token_lps[at], ranks[at]
                )

    def add_step_prompt_logprobs(
        self, scheduler_output: SchedulerOutput, prompt_logprobs: tuple
    ) -> None:
        """Record one step's prompt logprobs (rows: the step's scheduled tokens, in order) for
        the requests that asked for them."""
        row = 0
        for request in scheduler_output.scheduled_requests:
            n = scheduler_output.num_scheduled_tokens[request.request_id]
            if request.sampling_params.prompt_logprobs is not None and not request.is_finished:
                self.add_prompt_logprobs(
                    request, request.num_computed_tokens, prompt_logprobs, row, n
                )
            row += n

    def add_prompt_logprobs(
        self,
        request: Request,
        start: int,
        arrays: tuple[np.ndarray, ...],
        row_start: int,
        num_rows: int,
    ) -> None:
        """Record prompt logprobs from this step's rows `row_start ..` (the scheduled tokens at
        positions `start ..`; row i predicts prompt position start + i + 1)."""
        state = self._states[request.request_id]
        top_ids, top_lps, target_lps, ranks = arrays
        prompt = request.prompt_token_ids
        decode = self._decoder(request)
        k = request.sampling_params.prompt_logprobs
        for i in range(num_rows):
            position = start + i + 1
            if position >= len(prompt) or state.prompt_logprobs[position] is not None:
                continue  # past the prompt, or already recorded before a preemption
            row = row_start + i
            state.prompt_logprobs[position] = logprobs_entry(
                k, top_ids[row], top_lps[row], prompt[position], target_lps[row], ranks[row], decode
            )

    def detokenize(self, request: Request) -> str | None:
        """Detokenize the request's new tokens; returns the stop string it hit, if any.

        The output tokens after the one that completes a stop string are dropped from the
        request (and from its logprobs): a decode window may have sampled some."""
        state = self._states[request.request_id]
        params = request.sampling_params
        first = state.num_processed
        new_tokens = request.output_token_ids[first:]
        state.num_processed = len(request.output_token_ids)
        if state.detokenizer is None or request.status == RequestStatus.FINISHED_ABORTED:
            return None
        if (
            new_tokens
            and request.status == RequestStatus.FINISHED_STOPPED
            and not params.include_stop_str_in_output
            and _is_stop_token(request, new_tokens[-1])
        ):
            # Stopped by a stop token id or EOS (a stop string finishes the request only after
            # this, a grammar's end on a token of its text): as in vLLM, that token stays in
            # token_ids but its text is not output.
            new_tokens = new_tokens[:-1]
        for i, token in enumerate(new_tokens):
            delta = state.detokenizer.add_token(token)
            state.text += delta
            # As vLLM: no stop string ends a request before min_tokens, nor is one found later
            # in the text of those first tokens (the search looks at each token's new text).
            if not delta or not params.stop or first + i + 1 <= params.min_tokens:
                continue
            hit = _find_stop(state.text, len(delta), params.stop)
            if hit is not None:
                stop, idx = hit
                state.text = state.text[
                    : idx + len(stop) if params.include_stop_str_in_output else idx
                ]
                self._drop_tokens_after(request, state, first + i + 1)
                return stop
        return None

    def _drop_tokens_after(self, request: Request, state: _RequestState, num_kept: int) -> None:
        if num_kept >= request.num_output_tokens:
            return
        del request.output_token_ids[num_kept:]
        del request.all_token_ids[request.num_prompt_tokens + num_kept :]
        state.num_processed = num_kept
        if state.logprobs is not None:  # each entry's first key is its sampled token
            dropped = state.logprobs[num_kept:]
            del state.logprobs[num_kept:]
            state.cumulative_logprob -= sum(next(iter(e.values())).logprob for e in dropped)

    def make_output(self, request: Request) -> RequestOutput | None:
        """This step's output of the request under its output kind; None when there is nothing
        to report (FINAL_ONLY before the end, or parallel samples still running)."""
        state = self._states[request.request_id]
        params = request.sampling_params
        finished = request.is_finished
        kind = params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(request, state, finished, kind == RequestOutputKind.DELTA)
        if finished:  # only once its output is made: a failure above leaves it to discard()
            del self._states[request.request_id]
        prompt_logprobs = state.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            prompt_logprobs = None if state.sent_prompt_logprobs else prompt_logprobs
            state.sent_prompt_logprobs = True
        request_id, outputs = request.request_id, [completion]
        if state.parent is not None:
            request_id = state.parent.request_id
            outputs, finished = state.parent.get_outputs(request.request_id, completion)
            if not outputs:
                return None
        return RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=request.metrics,
        )

    def discard(self, request: Request) -> None:
        """Forget a request whose output could not be made (its sample leaves its parent's)."""
        state = self._states.pop(request.request_id, None)
        if state is not None and state.parent is not None:
            state.parent.drop(request.request_id)

    def _completion(
        self, request: Request, state: _RequestState, finished: bool, delta: bool
    ) -> CompletionOutput:
        text = state.text
        hold = request.sampling_params.stop_buffer_length
        if hold and not finished:
            text = text[: max(len(text) - hold, 0)]
        logprobs = state.logprobs
        if delta:  # only the new tail is copied: a whole copy per step is quadratic per request
            text = text[state.num_sent_chars :]
            token_ids = request.output_token_ids[state.num_sent_tokens :]
            if logprobs is not None:
                logprobs = logprobs[state.num_sent_tokens :]
            state.num_sent_chars += len(text)
            state.num_sent_tokens += len(token_ids)
        else:
            token_ids = list(request.output_token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=RequestStatus.finish_reason(request.status) if finished else None,
            stop_reason=request.stop_reason,
        )


def _is_stop_token(request: Request, token_id: int) -> bool:
    """Whether `token_id` is one of the request's stop token ids or (unless ignored) its EOS."""
    params = request.sampling_params
    if token_id in params.stop_token_ids:
        return True
    return token_id == request.eos_token_id and not params.ignore_eos
