"""What a streamed request's consumer sees, per RequestOutputKind (see AsyncLLM.generate)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jvllm.outputs import CompletionOutput, RequestOutput
from jvllm.sampling_params import RequestOutputKind


class OutputShaper:
    """Turns a request's cumulative outputs into the kind its consumer asked for: everything so far
    (CUMULATIVE), what is new (DELTA), or all completions once, at the end (FINAL_ONLY)."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.completions: dict[int, CompletionOutput] = {}  # latest cumulative, per index
        self._num_chars: dict[int, int] = {}
        self._num_tokens: dict[int, int] = {}
        self._done: set[int] = set()

    def shape(
        self, header: RequestOutput, changed: list[CompletionOutput], finished: bool
    ) -> RequestOutput | None:
        for completion in changed:
            self.completions[completion.index] = completion
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind != RequestOutputKind.DELTA:
            outputs = [self.completions[i] for i in sorted(self.completions)]
            return dataclasses.replace(header, outputs=outputs, finished=finished)
        deltas = [d for d in map(self._delta, changed) if d is not None]
        if not deltas and not finished:
            return None
        return dataclasses.replace(header, outputs=deltas, finished=finished)

    def _delta(self, completion: CompletionOutput) -> CompletionOutput | None:
        index = completion.index
        num_chars = self._num_chars.get(index, 0)
        num_tokens = self._num_tokens.get(index, 0)
        text = completion.text
        is_done = completion.finish_reason is not None
        # The engine's running text already holds back what may start a stop string.
        end = len(text)
        if (
            end == num_chars
            and len(completion.token_ids) == num_tokens
            and (not is_done or index in self._done)
        ):
            return None
        changes: dict[str, Any] = {
            "text": text[num_chars:end],
            "token_ids": list(completion.token_ids[num_tokens:]),
        }
        logprobs = getattr(completion, "logprobs", None)
        if logprobs is not None:
            changes["logprobs"] = list(logprobs[num_tokens:])
        self._num_chars[index] = end
        self._num_tokens[index] = len(completion.token_ids)
        if is_done:
            self._done.add(index)
        return dataclasses.replace(completion, **changes)

    def abort(
        self, header: RequestOutput | None, changed: list[CompletionOutput], request_id: str
    ) -> RequestOutput:
        """The final output of a request ended by `AsyncLLM.abort()`, holding what `changed`
        brought that the consumer has not seen yet."""
        for completion in changed:
            self.completions[completion.index] = completion
        ended = [
            dataclasses.replace(c, finish_reason=c.finish_reason or "abort")
            for c in (self.completions[i] for i in sorted(self.completions))
        ]
        if self.kind == RequestOutputKind.DELTA:
            ended = [self._delta(c) or dataclasses.replace(c, text="", token_ids=[]) for c in ended]
        ended = ended or [CompletionOutput(0, "", [], finish_reason="abort")]
        if header is None:
            return RequestOutput(request_id, None, [], ended, finished=True)
        return dataclasses.replace(header, outputs=ended, finished=True)
