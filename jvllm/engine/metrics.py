"""Prometheus metrics for the server, with vLLM's names under a `jvllm:` prefix.

Scheduler state (running, waiting, KV usage, prefix cache) is read from `AsyncLLM.stats` at scrape
time; per-request timings and token counts are recorded on the event loop from each step's outputs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets, in seconds.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _SchedulerCollector:
    """Gauges and cumulative counters taken from the engine's latest `SchedulerStats`."""

    def __init__(self, async_llm, model_name: str):
        self._async_llm = async_llm
        self._labels = {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self):
        stats = self._async_llm.stats
        g, c = GaugeMetricFamily, CounterMetricFamily
        hit_rate = (
            stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else 0.0
        )
        yield self._family(
            g,
            "jvllm:num_requests_running",
            "Requests in model execution batches.",
            stats.num_running,
        )
        yield self._family(
            g, "jvllm:num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting
        )
        yield self._family(
            g, "jvllm:kv_cache_usage_perc", "KV cache usage (1 = 100%).", stats.kv_cache_usage
        )
        yield self._family(
            g,
            "jvllm:prefix_cache_hit_rate",
            "Prefix cache hit rate over all queried tokens (0 to 1).",
            hit_rate,
        )
        yield self._family(
            c,
            "jvllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield self._family(
            c,
            "jvllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        )
        yield self._family(
            c, "jvllm:num_preemptions", "Preemptions (by recompute).", stats.num_preemptions
        )


class ServingMetrics:
    """Every metric of one served model, in its own registry (several servers share a process in
    tests). Register with `AsyncLLM(..., stat_loggers=[metrics])`."""

    def __init__(self, async_llm, model_name: str, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # no `*_created` series, as in vLLM
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        self.registry.register(_SchedulerCollector(async_llm, model_name))
        kw = {"labelnames": labels, "registry": self.registry}
        self.prompt_tokens = Counter("jvllm:prompt_tokens", "Prefill tokens processed.", **kw)
        self.generation_tokens = Counter(
            "jvllm:generation_tokens", "Generation tokens processed.", **kw
        )
        self.request_success = Counter(
            "jvllm:request_success",
            "Finished requests.",
            labelnames=labels + ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "jvllm:time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS, **kw
        )
        self.itl = Histogram(
            "jvllm:inter_token_latency_seconds", "Inter-token latency.", buckets=_ITL_BUCKETS, **kw
        )
        self.e2e = Histogram(
            "jvllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=_E2E_BUCKETS,
            **kw,
        )
        self._model = model_name

    def record(self, items, now: float) -> None:
        """One step's `(stream, cumulative output)` pairs, on the event loop."""
        model = self._model
        num_generated = 0
        for stream, output in items:
            new = 0
            for completion in output.outputs:
                seen = stream.num_tokens_seen.get(completion.index, 0)
                new += len(completion.token_ids) - seen
                stream.num_tokens_seen[completion.index] = len(completion.token_ids)
            if new > 0:
                if stream.last_token_time is None:
                    self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
                    self.ttft.labels(model).observe(now - stream.arrival_time)
                else:
                    self.itl.labels(model).observe(now - stream.last_token_time)
                stream.last_token_time = now
                num_generated += new
            if output.finished:
                self.e2e.labels(model).observe(now - stream.arrival_time)
                reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
                self.request_success.labels(model, reasons[-1] if reasons else "abort").inc()
        if num_generated:
            self.generation_tokens.labels(model).inc(num_generated)
