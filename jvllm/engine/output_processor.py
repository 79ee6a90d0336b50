"""Turns requests' new tokens into `RequestOutput`s: detokenization and stop strings."""

import dataclasses

from jvllm.core.request import Request, RequestStatus
from jvllm.engine.detokenizer import IncrementalDetokenizer
from jvllm.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer | None
    num_processed: int = 0  # output tokens already detokenized
    text: str = ""  # output text, cut at a stop string


def _find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string in `text` that overlaps its last `num_new_chars` characters."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        self._states[request.request_id] = _RequestState(detok)

    def has_new_tokens(self, request: Request) -> bool:
        return self._states[request.request_id].num_processed < request.num_output_tokens

    def detokenize(self, request: Request) -> str | None:
        """Detokenize the request's new tokens; returns the stop string it hit, if any."""
        state = self._states[request.request_id]
        params = request.sampling_params
        new_tokens = request.output_token_ids[state.num_processed :]
        state.num_processed = len(request.output_token_ids)
        if state.detokenizer is None or request.status == RequestStatus.FINISHED_ABORTED:
            return None
        for token in new_tokens:
            delta = state.detokenizer.add_token(token)
            state.text += delta
            if not delta or not params.stop:
                continue
            hit = _find_stop(state.text, len(delta), params.stop)
            if hit is not None:
                stop, idx = hit
                state.text = state.text[: idx + len(stop) if params.include_stop_str_in_output else idx]
                return stop
        return None

    def make_output(self, request: Request) -> RequestOutput:
        state = self._states[request.request_id]
        finished = RequestStatus.is_finished(request.status)
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            finish_reason=RequestStatus.finish_reason(request.status) if finished else None,
            stop_reason=request.stop_reason,
        )
        if finished:
            del self._states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
