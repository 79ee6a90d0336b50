"""What the engine returns: vLLM's `RequestOutput`, `CompletionOutput`, `Logprob` and beam search
outputs."""

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One token's log-probability, its rank among the vocabulary (1 = the most likely) and its
    text (None without detokenization)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: {token_id: Logprob} (the top-k and the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: None for the first token (nothing predicts it), then as above.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # None unless logprobs were requested
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class BeamSearchSequence:
    """One finished beam: all its tokens (prompt included, as in vLLM) and its score's parts."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
