"""Prometheus metrics for the server: vLLM's series, names, types and buckets, under a `jvllm:`
prefix, or `vllm:` (`jvllm serve --metrics-prefix vllm`) for dashboards written for vLLM.

Scheduler state (running, waiting, KV usage, prefix cache) is read from `AsyncLLM.stats` at scrape
time; the engine thread refreshes it after every step and every batch of adds and aborts, so the
gauges read 0 as soon as the engine is idle. Per-request timings and token counts are recorded on
the event loop from each step's outputs; tokens per step and aborts on the engine thread.
"""

from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jvllm.engine.data_parallel import replicas

FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values jvllm reports
_PREFIX_PATTERN = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
# fmt: off
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
# End to end, and its queue, prefill, decode and inference parts.
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# fmt: on


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def check_metrics_prefix(prefix: str) -> None:
    if not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(
            f"metrics prefix must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), such as jvllm "
            f"or vllm; got {prefix!r}"
        )


class _SchedulerCollector:
    """Gauges and cumulative counters taken from the engine's latest `SchedulerStats`."""

    def __init__(self, async_llm, model_name: str, prefix: str):
        self._async_llm = async_llm
        self._labels = {"model_name": model_name}
        self._prefix = prefix

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(f"{self._prefix}:{name}", doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self):
        stats = self._async_llm.stats
        g, c = GaugeMetricFamily, CounterMetricFamily
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        yield self._family(
            g, "num_requests_running", "Requests in model execution batches.", stats.num_running
        )
        yield self._family(
            g, "num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting
        )
        yield self._family(
            g, "kv_cache_usage_perc", "KV cache usage (1 = 100%).", stats.kv_cache_usage
        )
        yield self._family(
            g,
            "prefix_cache_hit_rate",
            "Prefix cache hit rate over all queried tokens (0 to 1).",
            hits / queries if queries else 0.0,
        )
        yield self._family(
            c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries
        )
        yield self._family(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield self._family(
            c, "num_preemptions", "Preemptions (by recompute).", stats.num_preemptions
        )
        if stats.expert_token_counts is not None:
            yield self._expert_tokens(stats)
        config = self._async_llm.engine.engine_config
        if config.speculative_config is not None:  # vLLM's spec_decode_* counters
            yield from self._spec_decoding(stats)
        if config.lora_config is not None:  # vLLM's: the state in the labels, the value the time
            labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            info = g(f"{self._prefix}:lora_requests_info", "Running stats on LoRA requests.",
                     labels=labels)  # fmt: skip
            waiting, running = stats.waiting_lora_adapters, stats.running_lora_adapters
            info.add_metric(
                [str(config.lora_config.max_loras), ",".join(waiting), ",".join(running)],
                time.time(),
            )
            yield info

    def _expert_tokens(self, stats):
        """Per layer and expert, what an expert placement is balanced by: L_moe x E series
        (DeepSeek-V3's 58 x 256 = 14,848, a scrape of about 1.5 MB)."""
        family = CounterMetricFamily(
            f"{self._prefix}:moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer (a token counts once for each of "
            "its top-k experts).",
            labels=[*self._labels, "layer", "expert"],
        )
        model_name = self._labels["model_name"]
        for i, row in enumerate(stats.expert_token_counts.tolist()):
            layer = str(stats.first_moe_layer + i)
            for expert, count in enumerate(row):
                family.add_metric([model_name, layer, str(expert)], count)
        return family

    def _spec_decoding(self, stats):
        c = CounterMetricFamily
        yield self._family(c, "spec_decode_num_drafts", "Drafts proposed.", stats.spec_num_drafts)
        yield self._family(
            c, "spec_decode_num_draft_tokens", "Draft tokens.", stats.spec_num_draft_tokens
        )
        yield self._family(
            c,
            "spec_decode_num_accepted_tokens",
            "Accepted draft tokens.",
            stats.spec_num_accepted_tokens,
        )
        per_pos = c(
            f"{self._prefix}:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position.",
            labels=[*self._labels, "position"],
        )
        for position, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
            per_pos.add_metric([*self._labels.values(), str(position)], count)
        yield per_pos


class ServingMetrics:
    """Every metric of one served model, in its own registry (several servers share a process in
    tests). Register with `AsyncLLM(..., stat_loggers=[metrics])`; the HTTP layer calls
    `record_rejected` for each generation request it refuses before it reaches the engine."""

    def __init__(
        self,
        async_llm,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefix: str = "jvllm",
    ):
        check_metrics_prefix(prefix)
        disable_created_metrics()  # no `*_created` series, as in vLLM
        self.registry = registry or CollectorRegistry()
        self.registry.register(_SchedulerCollector(async_llm, model_name, prefix))
        self._model = model_name
        self._prefix = prefix
        token_buckets = build_1_2_5_buckets(async_llm.max_model_len)
        make = self._make
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generation tokens processed.")
        self.request_success = make(
            Counter, "request_success", "Finished requests.", ["finished_reason"]
        )
        for reason in FINISHED_REASONS:  # every reason's series exists from the start
            self.request_success.labels(model_name, reason)
        self.requests_rejected = make(
            Counter,
            "num_requests_rejected",
            "Generation requests refused before reaching the engine (jvllm's own series).",
            ["reason"],
        )
        self.iteration_tokens = make(
            Histogram,
            "iteration_tokens_total",
            "Tokens computed per engine step.",
            buckets=_ITERATION_TOKENS_BUCKETS,
        )
        self.request_prompt_tokens = make(
            Histogram, "request_prompt_tokens", "Prompt tokens of a request.", buckets=token_buckets
        )
        self.request_generation_tokens = make(
            Histogram,
            "request_generation_tokens",
            "Tokens generated for a request (all its completions).",
            buckets=token_buckets,
        )
        self.request_max_num_generation_tokens = make(
            Histogram,
            "request_max_num_generation_tokens",
            "Tokens generated for a request's longest completion.",
            buckets=token_buckets,
        )
        self.request_params_n = make(
            Histogram, "request_params_n", "The n request parameter.", buckets=_N_BUCKETS
        )
        self.request_params_max_tokens = make(
            Histogram,
            "request_params_max_tokens",
            "The max_tokens request parameter.",
            buckets=token_buckets,
        )
        self.ttft = make(
            Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS
        )
        self.itl = make(
            Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=_ITL_BUCKETS
        )
        self.request_tpot = make(
            Histogram,
            "request_time_per_output_token_seconds",
            "A request's mean time per output token after its first.",
            buckets=_ITL_BUCKETS,
        )
        self.request_times = {
            phase: make(Histogram, name, doc, buckets=_REQUEST_LATENCY_BUCKETS)
            for phase, name, doc in (
                ("e2e", "e2e_request_latency_seconds", "End-to-end request latency."),
                ("queue", "request_queue_time_seconds", "Arrival to first scheduled (WAITING)."),
                ("prefill", "request_prefill_time_seconds", "Scheduled to first token (PREFILL)."),
                ("decode", "request_decode_time_seconds", "First token to last (DECODE)."),
                ("inference", "request_inference_time_seconds", "Scheduled to last token."),
            )
        }
        info = _cache_config(async_llm.engine)
        make(Gauge, "cache_config_info", "The KV cache's settings.", list(info)).labels(
            model_name, *info.values()
        ).set(1)

    def _make(self, cls, name: str, doc: str, extra_labels=(), **kwargs):
        """A metric labelled with the model name: the labelled child, or with `extra_labels`
        the parent, for `.labels(model_name, ...)`."""
        metric = cls(
            f"{self._prefix}:{name}",
            doc,
            labelnames=["model_name", *extra_labels],
            registry=self.registry,
            **kwargs,
        )
        return metric if extra_labels else metric.labels(self._model)

    # ---- the event loop: each step's outputs ----

    def record(self, items, now: float) -> None:
        """One step's `(stream, cumulative output)` pairs."""
        num_generated = 0
        for stream, output in items:
            new = 0
            for completion in output.outputs:
                seen = stream.num_tokens_seen.get(completion.index, 0)
                new += len(completion.token_ids) - seen
                stream.num_tokens_seen[completion.index] = len(completion.token_ids)
            if new > 0:
                if stream.last_token_time is None:
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                    self.ttft.observe(now - stream.arrival_time)
                else:
                    self.itl.observe(now - stream.last_token_time)
                stream.last_token_time = now
                num_generated += new
            if output.finished:
                self._record_finished(stream, output, now)
        if num_generated:
            self.generation_tokens.inc(num_generated)

    def _record_finished(self, stream, output, now: float) -> None:
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        self.request_success.labels(self._model, reasons[-1] if reasons else "abort").inc()
        num_tokens = [len(c.token_ids) for c in output.outputs] or [0]
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(num_tokens))
        self.request_max_num_generation_tokens.observe(max(num_tokens))
        params = stream.sampling_params
        self.request_params_n.observe(params.n)
        if params.max_tokens is not None:  # None: until max_model_len
            self.request_params_max_tokens.observe(params.max_tokens)
        times = self.request_times
        times["e2e"].observe(now - stream.arrival_time)
        # The engine's milestones (wall clock). The first schedule, not the latest as in vLLM:
        # a preempted request's queue time ends when it first ran.
        m = output.metrics
        if m is None or m.first_scheduled_time is None:
            return
        times["queue"].observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        decode = m.last_token_time - m.first_token_time
        times["prefill"].observe(m.first_token_time - m.first_scheduled_time)
        times["decode"].observe(decode)
        times["inference"].observe(m.last_token_time - m.first_scheduled_time)
        if max(num_tokens) > 1:
            self.request_tpot.observe(decode / (max(num_tokens) - 1))

    # ---- the engine thread ----

    def record_step(self, num_tokens: int) -> None:
        """Prompt and generated tokens one engine step computed."""
        self.iteration_tokens.observe(num_tokens)

    def record_aborted(self, stream) -> None:
        """A request aborted before it finished (its client went away, or `abort()`)."""
        self.request_success.labels(self._model, "abort").inc()

    # ---- the HTTP layer ----

    def record_rejected(self, reason: str) -> None:
        """A generation request refused before it reached the engine; `reason` names why
        ("invalid_request" for a 400)."""
        self.requests_rejected.labels(self._model, reason).inc()


def _cache_config(engine) -> dict[str, str]:
    """vLLM's cache_config_info labels that jvllm has, per data-parallel replica (the replicas'
    pools are alike). num_gpu_blocks counts the null block, as vLLM's does."""
    cache = engine.engine_config.cache_config
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": str(cache.kv_cache_dtype),  # vLLM's: the setting, "auto" the model's
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks": str(replicas(engine)[0].scheduler.kv_cache_manager.num_blocks),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
    }
