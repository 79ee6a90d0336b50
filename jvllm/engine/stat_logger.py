"""The engine's state after a step, and the line a server logs about it every few seconds, as
vLLM's LoggingStatLogger does."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jvllm.logger import init_logger

logger = init_logger(__name__)

INTERVAL_ENV = "JVLLM_LOG_STATS_INTERVAL"  # seconds between lines (vLLM's default: 10)


@dataclasses.dataclass
class SchedulerStats:
    """What the engine looked like after a step; read by the metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # computed so far (prefix-cache hits excluded)
    num_generation_tokens: int = 0  # sampled so far
    # The LoRA adapters of the running and of the waiting requests, by name, each once.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Speculative decoding's counters (core/spec_decode.py's SpecDecodingStats), summed.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # A model with routed experts: each MoE layer's (token, expert) assignments so far,
    # i64[L_moe, E], row i layer first_moe_layer + i (worker/model_runner.py); None without.
    expert_token_counts: np.ndarray | None = None
    first_moe_layer: int = 0


def scheduler_stats(engines) -> SchedulerStats:
    """The stats now, summed over the data-parallel replicas' `engines` (KV usage: their
    mean)."""
    schedulers = [engine.scheduler for engine in engines]
    kvs = [s.kv_cache_manager for s in schedulers]
    return SchedulerStats(
        num_running=sum(len(s.running) for s in schedulers),
        num_waiting=sum(len(s.waiting) for s in schedulers),
        kv_cache_usage=sum(kv.usage for kv in kvs) / len(kvs),
        prefix_cache_queries=sum(kv.prefix_cache_queries for kv in kvs),
        prefix_cache_hits=sum(kv.prefix_cache_hits for kv in kvs),
        num_preemptions=sum(s.num_preemptions_total for s in schedulers),
        num_prompt_tokens=sum(s.num_prompt_tokens_total for s in schedulers),
        num_generation_tokens=sum(s.num_generation_tokens_total for s in schedulers),
        running_lora_adapters=_adapter_names(r for s in schedulers for r in s.running),
        waiting_lora_adapters=_adapter_names(r for s in schedulers for r in s.waiting),
        **_spec_decoding_counts(schedulers),
        **_expert_token_counts([engine.model_runner for engine in engines]),
    )


def _spec_decoding_counts(schedulers) -> dict:
    """SchedulerStats' speculative-decoding fields, summed over `schedulers` (none without
    drafts)."""
    stats = [s.drafter.stats for s in schedulers if s.drafter is not None]
    if not stats:
        return {}
    per_pos = [sum(counts) for counts in zip(*(s.num_accepted_tokens_per_pos for s in stats))]
    return {
        "spec_num_drafts": sum(s.num_drafts for s in stats),
        "spec_num_draft_tokens": sum(s.num_draft_tokens for s in stats),
        "spec_num_accepted_tokens": sum(s.num_accepted_tokens for s in stats),
        "spec_num_accepted_tokens_per_pos": tuple(per_pos),
    }


def _expert_token_counts(runners) -> dict:
    """SchedulerStats' expert-count fields, summed over the data-parallel replicas' model
    `runners` (none for a model without routed experts)."""
    counts = [r.expert_token_counts for r in runners if r.expert_token_counts is not None]
    if not counts:
        return {}
    return {
        "expert_token_counts": counts[0] if len(counts) == 1 else sum(counts),
        "first_moe_layer": runners[0].config.num_layers - counts[0].shape[0],
    }


def _adapter_names(requests) -> tuple[str, ...]:
    """The LoRA adapters `requests` run with, by name, each once, in order."""
    return tuple(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request))


class LoggingStatLogger:
    """Logs throughput and scheduler state from the `SchedulerStats` the engine thread snapshots.

    The first `maybe_log` call sets the baseline; then it is called after every step and while
    idle, and logs at most once per interval, and once more after the engine goes quiet (the
    line with zeros), then stays silent.
    """

    def __init__(self, interval: float | None = None):
        self.interval = _interval_from_env() if interval is None else interval
        self._last_time: float | None = None
        self._last = None  # SchedulerStats at the last line
        self._was_busy = False

    def maybe_log(self, stats: SchedulerStats, now: float) -> None:
        if self._last_time is None:
            self._last_time, self._last = now, stats
            return
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        last = self._last
        num_prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        num_generation = stats.num_generation_tokens - last.num_generation_tokens
        is_busy = bool(num_prompt or num_generation or stats.num_running or stats.num_waiting)
        if is_busy or self._was_busy:
            queries = stats.prefix_cache_queries
            hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                num_prompt / elapsed,
                num_generation / elapsed,
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_cache_usage,
                100 * hit_rate,
            )
        self._was_busy = is_busy
        self._last_time, self._last = now, stats


def _interval_from_env() -> float:
    raw = os.environ.get(INTERVAL_ENV, "10")
    try:
        interval = float(raw)
    except ValueError:
        interval = 0.0
    if not interval > 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {raw!r}")
    return interval
