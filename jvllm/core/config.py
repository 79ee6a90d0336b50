"""Scheduler configuration."""

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Limits of one scheduling step.

    `max_num_batched_tokens` is the token budget of a step, `max_num_seqs` caps the running
    requests, `long_prefill_token_threshold` (0 = off) caps one request's share of a step so that
    a long prompt is prefilled in chunks beside the decodes. Without chunked prefill a prompt is
    scheduled whole or not at all, so the budget must hold the longest prompt.
    """

    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # Decode steps one device call may run when every running request decodes (see
    # core/decode_window.py); 1 = one step per call.
    num_scheduler_steps: int = 1
    # vLLM's: "fcfs" serves requests in arrival order; "priority" by (priority, arrival time),
    # lowest first, and preempts the running request that comes last in that order.
    policy: str = "fcfs"
    # The most LoRA adapters the running requests may use at once (the runner's slots).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "num_scheduler_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be an int >= 0 (0 = off), got {threshold!r}"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(  # noqa: TRY004 - every bad engine option is a ValueError, as in vLLM
                f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len "
                    f"({self.max_model_len}) when chunked prefill is disabled, "
                    f"got {self.max_num_batched_tokens}"
                )
            if threshold > 0:
                raise ValueError(
                    "long_prefill_token_threshold must be 0 when chunked prefill is disabled, "
                    f"got {threshold}"
                )
