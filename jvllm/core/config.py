"""Scheduler configuration."""

from dataclasses import dataclass

from jvllm.core.checks import check_bool, check_choice, check_int

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    `max_num_batched_tokens` is the token budget of a step, `max_num_seqs` caps the running
    requests, `long_prefill_token_threshold` (0 = off) caps one request's share of a step so that
    a long prompt is prefilled in chunks beside the decodes. Without chunked prefill a prompt is
    scheduled whole or not at all, so the budget must hold the longest prompt.
    """

    max_model_len: int | None  # None only in an EngineConfig before the model is loaded
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
    # vLLM's encoder budget: the image embeddings one step may encode, and the rows the
    # encoder cache holds (core/encoder_cache_manager.py). The engine sets both for a model
    # that takes images, at least its largest image's.
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # A model whose image tokens attend to their whole image (Gemma 3): a step never ends
    # inside an image's tokens.
    keep_images_whole: bool = False

    def __post_init__(self) -> None:
        check_choice("scheduling_policy", self.policy, SCHEDULING_POLICIES)
        check_int("max_model_len", self.max_model_len, optional=True)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("num_scheduler_steps", self.num_scheduler_steps)
        threshold = self.long_prefill_token_threshold
        check_int("long_prefill_token_threshold", threshold, 0, why="0 = off")
        check_int("max_loras", self.max_loras, 0)
        check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 0)
        check_int("encoder_cache_size", self.encoder_cache_size, 0)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if not self.enable_chunked_prefill:
            if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    "max_num_batched_tokens must be >= max_model_len "
                    f"({self.max_model_len}) when chunked prefill is disabled, "
                    f"got {self.max_num_batched_tokens}"
                )
            if self.long_prefill_token_threshold > 0:
                raise ValueError(
                    "long_prefill_token_threshold must be 0 when chunked prefill is disabled, "
                    f"got {self.long_prefill_token_threshold}"
                )
