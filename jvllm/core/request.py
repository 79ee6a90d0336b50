"""A request's state on the host: its tokens, its two racing counters and its status."""

import enum
import time
from collections.abc import Iterable

from jvllm.core.multimodal import MultiModalFeature
from jvllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED_*, with RUNNING -> PREEMPTED -> RUNNING
    under memory pressure (preemption by recompute). Every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        """The OpenAI-style finish reason: "stop", "length", "abort", or None while unfinished."""
        return _FINISH_REASONS.get(status)


# IGNORED (a prompt too long to ever fit) reports "length", as vLLM does.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    """One generation request. `num_computed_tokens` (tokens whose KV is in the cache) chases
    `num_tokens` (prompt + outputs); the request samples a token whenever it catches up.

    `seed` is the request's sampling seed; the engine passes one it drew when the user gave none.
    `cache_salt` (vLLM's): the request reuses only prefix-cache blocks computed under the same
    salt, so that users who do not share one cannot learn each other's prompts from hit timing.
    `priority` (vLLM's): under the "priority" scheduling policy, lower values are served first.
    `lora_request`: the LoRA adapter it runs with (jvllm/lora/), None for the base model.
    `mm_features`: its images, in prompt order (core/multimodal.py); empty for text.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        prompt: str | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request=None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.seed = sampling_params.seed if seed is None else seed
        self.cache_salt = cache_salt
        self.priority = priority
        self.lora_request = lora_request
        self.mm_features = sorted(mm_features or (), key=lambda f: f.placeholder.offset)
        # A model with M-RoPE (Qwen2-VL): the prompt's (t, h, w) rotary positions, i32[3,
        # num_prompt_tokens], and the shift of every later token's (its index + rope_delta in
        # all three); None: each token's index, as for text.
        self.rope_positions = None
        self.rope_delta = 0

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at first scheduling; -1 until then.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # The stop token id (or stop string, set by the output processor) that ended it.
        self.stop_reason: int | str | None = None
        # Why the engine ended the request on its own (e.g. why it was IGNORED).
        self.status_message: str | None = None
        # Chain hashes of the request's full blocks, in order; filled by the KV cache manager
        # and kept across preemption so a resumed request finds its own blocks again.
        self.block_hashes: list[bytes] = []
        # `sampling_params.bad_words` as token id sequences (the engine tokenizes them).
        self.bad_words_token_ids: list[list[int]] = []
        # Milestone times (a jvllm.outputs.RequestMetrics); the engine fills it in.
        self.metrics = None
        # The matcher of a request with structured_outputs (a structured_output.GrammarState:
        # is_ready(), error, accept(token_id), is_terminated), set by the engine; else None.
        self.structured_output = None
        # A pooling request's jvllm.PoolingParams (set by the engine): it computes its prompt and
        # finishes, sampling nothing; None for a generation request.
        self.pooling_params = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_computed_tokens={self.num_computed_tokens}, num_tokens={self.num_tokens})"
        )
